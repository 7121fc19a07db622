"""Panel/Bokeh components of the planner (built in a later issue; imports engine, panel, bokeh)."""
