"""One alert bound to ``PlanState.message``: the app's status line (plans, edits, searches, imports)."""

from __future__ import annotations

import panel as pn

from planner_ui.state import PlanState

#: ``PlanState.message_kind`` -> ``pn.pane.Alert.alert_type``.
ALERT_TYPES = {"info": "info", "success": "success", "error": "danger"}


def message_bar(state: PlanState) -> pn.pane.Alert:
    """A ``pn.pane.Alert`` (css ``tessel-message``) that follows ``state.message``/``message_kind``;
    hidden while there is no message."""
    alert = pn.pane.Alert(state.message, alert_type=ALERT_TYPES.get(state.message_kind, "info"),
                          visible=bool(state.message), css_classes=["tessel-message"], sizing_mode="stretch_width",
                          margin=(0, 10))

    def update(*_events) -> None:
        alert.param.update(object=state.message, alert_type=ALERT_TYPES.get(state.message_kind, "info"),
                           visible=bool(state.message))

    state.param.watch(update, ["message", "message_kind"])
    return alert


__all__ = ["message_bar", "ALERT_TYPES"]
