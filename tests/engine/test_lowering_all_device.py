"""Lowering the boundary between all-device blocks and one-device stages (SuperScaler phase 3).

The language model's M placement on 2 devices (``engine.shapes.m_model_shape``: the embedding
``0`` and the head ``3`` on both devices, blocks ``1`` and ``2`` on device 0 and 1), one
micro-batch, lowered by ``engine.dependency.lower`` and checked against the instruction lists
written out by hand: no transfer where the consumer runs on a device of the producer's set (the
all-device block's output is replicated there: ``0F -> 1F`` on device 0, ``3B -> 2B`` on
device 1), and a one-device producer sends to every device of an all-device consumer outside its
set (``2F -> 3F``: device 1 to device 0; ``1B -> 0B``: device 0 to device 1).
"""

from __future__ import annotations

from engine.dependency import lower
from engine.schedule import Block, Schedule
from engine.shapes import m_model_shape


def _blocks(spec: str) -> list[Block]:
    return [Block(int(x[0]), x[1], int(x[2])) for x in spec.split()]


def test_all_device_boundaries_lower_to_the_hand_written_streams():
    pl = m_model_shape(2)
    sched = Schedule(pl, 1, [_blocks("0F0 1F0 3F0 3B0 1B0 0B0"), _blocks("0F0 2F0 3F0 3B0 2B0 0B0")])
    sched.validate()
    streams = [[str(i) for i in s] for s in lower(sched).streams]
    assert streams[0] == ["0F0", "1F0", "SEND 1F0 to 1", "RECV 2F0 from 1", "3F0", "3B0",
                          "RECV 2B0 from 1", "1B0", "SEND 1B0 to 1", "0B0", "OPTIM step"]
    assert streams[1] == ["0F0", "RECV 1F0 from 0", "2F0", "SEND 2F0 to 0", "3F0", "3B0",
                          "2B0", "SEND 2B0 to 0", "RECV 1B0 from 0", "0B0", "OPTIM step"]
