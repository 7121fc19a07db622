"""Mixture-of-experts models: gates (Switch, GShard top-2, DTS-Gate), the MoE FFN layer and GPT-MoE."""
from .gates import (
                    GATES,
                    BaseGate,
                    DTSGate,
                    GateOutput,
                    SwitchGate,
                    Top2Gate,
                    dts_temperature,
                    load_balancing_loss,
                    make_gate,
)
from .gpt_moe import GPTMoE, GPTMoEConfig
from .layer import ExpertMLP, MoEFeedForward

__all__ = ["GATES", "BaseGate", "DTSGate", "GateOutput", "SwitchGate", "Top2Gate",
           "dts_temperature", "load_balancing_loss", "make_gate", "ExpertMLP", "MoEFeedForward",
           "GPTMoE", "GPTMoEConfig"]
