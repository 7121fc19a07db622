"""Export and import: plan JSON, Chrome/Perfetto trace, torch pipelining CSV.

Downloads (Panel ``FileDownload`` buttons, built on click from the current state):

* plan JSON (:meth:`engine.io.plan.Plan.to_dict`, ``{"format": "tessel-plan", "version": 1}``);
* Perfetto trace of the predicted timeline (:func:`engine.io.trace.timeline_to_trace`, opens in
  ui.perfetto.dev), with the measured timeline of the last launch as ``measured_trace_json``;
* the measured timeline of the last launch, when there is one (same trace format);
* torch.distributed.pipelining CSV (``compute_only``; :func:`engine.io.torch_csv.schedule_to_csv_text`),
  only for schedules whose every block runs on one device.

Notebook users can write all three into a folder (:meth:`ExportPanel.save_to_folder`, atomic
writes). Import (a ``FileInput``, or :meth:`ExportPanel.import_bytes`) takes a plan JSON (loaded
as is) or a CSV (read as a new schedule for the CURRENT plan's placement); an import that fails
(malformed file, invalid schedule) shows the reason and leaves the state unchanged.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import panel as pn
import param

from engine.errors import PlanFormatError, TesselError
from engine.io.atomic import atomic_write_text
from engine.io.plan import Plan
from engine.io.torch_csv import read_torch_csv_text, schedule_to_csv_text
from engine.io.trace import timeline_to_trace
from planner_ui.state import PlanState


class ExportError(TesselError):
    """Nothing to export (no plan loaded), or a format that cannot express this plan."""


class ExportPanel(pn.viewable.Viewer):
    """Download / save / import plans.

    Construct with ``ExportPanel(state=state)``.

    Methods: :meth:`plan_json`, :meth:`trace_json`, :meth:`csv_text` (the file texts; raise
    :class:`ExportError` with a user sentence when they cannot be made), :meth:`save_to_folder`,
    :meth:`import_bytes` (``True`` when loaded).
    """

    state = param.ClassSelector(class_=PlanState, doc="the shared planner state")
    folder = param.String(default="tessel-out", doc="folder for save_to_folder")

    def __init__(self, **params):
        super().__init__(**params)
        if self.state is None:
            self.state = PlanState()
        self._build()
        self.state.param.watch(lambda *_: self._sync_buttons(), ["plan", "measured"])
        self._sync_buttons()

    # ------------------------------------------------------------------ texts
    def _plan(self) -> Plan:
        if self.state.plan is None:
            raise ExportError("no plan is loaded; plan a model, run a search or import a plan first")
        return self.state.plan

    def plan_json(self) -> str:
        """The plan JSON text (``Plan.to_dict``, indented)."""
        return json.dumps(self._plan().to_dict(), indent=1)

    def trace_json(self) -> str:
        """The Chrome/Perfetto trace JSON of the predicted timeline (``ts``/``dur`` in µs)."""
        plan = self._plan()
        return json.dumps(timeline_to_trace(self.state.timeline, name="tessel-planner",
                                            metadata=self._trace_meta(plan)))

    def measured_trace_json(self) -> str:
        """The trace of the measured timeline of the last launch.

        Raises:
            ExportError: no plan, or the plan has not been launched.
        """
        plan = self._plan()
        if self.state.measured is None:
            raise ExportError("this plan has no measured timeline; launch it first")
        return json.dumps(timeline_to_trace(self.state.measured, name="tessel-runtime",
                                            metadata={**self._trace_meta(plan), "measured": True}))

    def _trace_meta(self, plan: Plan) -> dict:
        m = self.state.metrics()
        return {"schedule": plan.schedule.name, "model": plan.model.name, "abstract": self.state.abstract,
                "makespan": m.get("makespan"), "bubble_ratio": m.get("bubble_ratio"),
                "time_unit": "units" if self.state.abstract else "s"}

    def csv_text(self) -> str:
        """The torch pipelining CSV (``compute_only``) of the schedule.

        Raises:
            ExportError: no plan, or a block runs on several devices (torch pipelining cannot
                express it; export the plan JSON instead).
        """
        try:
            return schedule_to_csv_text(self._plan().schedule)
        except PlanFormatError as e:
            raise ExportError(str(e)) from None

    def save_to_folder(self, folder: str | Path | None = None) -> list[Path]:
        """Write ``plan.json``, ``trace.json`` and (when expressible) ``schedule.csv`` into ``folder``
        atomically; returns the written paths and reports them in ``state.message``.

        A CSV that cannot be made is skipped with the reason in the message; no plan is an error
        message (nothing written).
        """
        out = Path(folder if folder is not None else self.folder).expanduser()
        try:
            texts = {"plan.json": self.plan_json(), "trace.json": self.trace_json()}
        except ExportError as e:
            self._say(str(e), "error")
            return []
        note = ""
        try:
            texts["schedule.csv"] = self.csv_text()
        except ExportError as e:
            note = f" (no schedule.csv: {e})"
        try:
            written = [atomic_write_text(out / name, text) for name, text in texts.items()]
        except OSError as e:
            self._say(f"cannot write to {out}: {e.strerror or e}", "error")
            return []
        self._say(f"wrote {', '.join(str(p) for p in written)}{note}", "success")
        return written

    # ------------------------------------------------------------------ import
    def import_bytes(self, filename: str, data: bytes) -> bool:
        """Import an uploaded file: a plan JSON (``*.json``) or a torch CSV (``*.csv``).

        A plan JSON replaces the plan (its own placement). A CSV is read as a schedule for the
        current plan's placement (one row per device), validated (dependencies, deadlock; memory
        against the state's limit) and loaded as the plan with that schedule. Any failure
        (undecodable text, a malformed field: the message names the field path, an invalid
        schedule) goes to ``state.message`` with kind ``"error"`` and the state is unchanged.

        Returns ``True`` when the file was loaded.
        """
        name = Path(filename or "upload").name
        suffix = Path(name).suffix.lower()
        try:
            text = bytes(data).decode("utf-8-sig")
        except UnicodeDecodeError as e:
            self._say(f"{name}: not UTF-8 text (byte {e.start}); import a plan JSON or a torch CSV", "error")
            return False
        try:
            if suffix == ".json":
                try:
                    doc = json.loads(text)
                except json.JSONDecodeError as e:
                    raise PlanFormatError(
                        f"{name}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
                plan = Plan.from_dict(doc, source=name)
                plan.schedule.validate(None)
                self.state.load(plan, message=f"imported {name}: {plan.schedule.name} plan of "
                                              f"{plan.model.name or '?'}")
            elif suffix == ".csv":
                base = self.state.plan
                if base is None:
                    raise PlanFormatError(f"{name}: a torch CSV is only an order of blocks; load or plan a model "
                                          "first so its placement is known (or import a plan JSON)")
                sched = read_torch_csv_text(text, base.placement, name=Path(name).stem, source=name)
                sched.validate(self.state.memory_limit)
                plan = replace(base, schedule=sched,
                               parallel=replace(base.parallel, micro_batches=sched.num_micro_batches))
                self.state.load(plan, graph=self.state.graph,
                                message=f"imported {name} as the schedule of the current placement "
                                        f"({sched.num_micro_batches} micro-batches)")
            else:
                raise PlanFormatError(
                    f"{name}: unknown file type {suffix or '(none)'}; import a plan .json or a torch .csv")
        except TesselError as e:
            self._say(f"import failed: {e}", "error")
            return False
        self.state.message_kind = "success"
        return True

    # ------------------------------------------------------------------ widgets
    def _download(self, make, filename: str) -> io.BytesIO:
        try:
            return io.BytesIO(make().encode("utf-8"))
        except TesselError as e:
            self._say(str(e), "error")
            return io.BytesIO(f"export failed: {e}\n".encode())

    def _build(self) -> None:
        w = pn.widgets
        self.plan_download = w.FileDownload(callback=lambda: self._download(self.plan_json, "plan.json"),
                                            filename="plan.json", label="Plan JSON", embed=False,
                                            css_classes=["tessel-export-plan"])
        self.trace_download = w.FileDownload(callback=lambda: self._download(self.trace_json, "trace.json"),
                                             filename="trace.json", label="Perfetto trace", embed=False,
                                             css_classes=["tessel-export-trace"])
        self.measured_download = w.FileDownload(callback=lambda: self._download(self.measured_trace_json,
                                                                                "measured.json"),
                                                filename="trace.measured.json", label="Measured trace", embed=False,
                                                css_classes=["tessel-export-measured-trace"])
        self.csv_download = w.FileDownload(callback=lambda: self._download(self.csv_text, "schedule.csv"),
                                           filename="schedule.csv", label="torch CSV", embed=False,
                                           css_classes=["tessel-export-csv"])
        self.folder_input = w.TextInput.from_param(self.param.folder, name="Folder",
                                                   css_classes=["tessel-export-folder"])
        self.save_button = w.Button(label="Save all to folder", css_classes=["tessel-export-save"])
        self.save_button.on_click(lambda _e: self.save_to_folder())
        self.file_input = w.FileInput(accept=".json,.csv", multiple=False, css_classes=["tessel-import"])
        self.file_input.param.watch(self._on_upload, "value")

    def _on_upload(self, event) -> None:
        if event.new:
            self.import_bytes(self.file_input.filename or "upload", event.new)

    def _sync_buttons(self) -> None:
        has = self.state.plan is not None
        self.plan_download.disabled = not has
        self.trace_download.disabled = not has
        self.measured_download.disabled = self.state.measured is None
        csv_ok = has and all(len(b.devices) == 1 for b in self.state.plan.placement.blocks)
        self.csv_download.disabled = not csv_ok
        self.csv_download.description = (None if csv_ok else
                                         "torch pipelining CSV needs every block on one device" if has else None)

    def _say(self, text: str, kind: str) -> None:
        self.state.message_kind = kind
        self.state.message = text

    def __panel__(self):
        return pn.Column(
            pn.pane.Markdown("**Export**"),
            pn.Row(self.plan_download, self.trace_download, self.csv_download, self.measured_download),
            pn.Row(self.folder_input, self.save_button),
            pn.pane.Markdown("**Import** a plan JSON, or a torch CSV for the current placement"),
            self.file_input,
            css_classes=["tessel-export-panel"],
        )


__all__ = ["ExportError", "ExportPanel"]
