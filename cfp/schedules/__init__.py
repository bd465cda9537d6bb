"""Pipeline schedules as data: actions and tables, the registry (GPipe, 1F1B, interleaved, ZB-H1, ZB-V),
their formulas, the generator for uneven stages and the event simulation. Below both the planner, which
prices them, and the runtime, which runs them."""
