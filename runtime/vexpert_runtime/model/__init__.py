"""MoE models: checkpoints, expert storage formats, routing, expert math, the EP forward and the reference."""
