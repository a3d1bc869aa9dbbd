"""Cost models: estimates of what a plan costs per device (memory; compute and communication later).

Stage: after checks, before search and rendering. Contract: every `estimate_*` function is pure,
takes the IR plus the layer catalogue (`plandsl.ir.layers`) and returns a breakdown, never one number;
hardware figures come from the plan's device table, never from constants in code.
"""
