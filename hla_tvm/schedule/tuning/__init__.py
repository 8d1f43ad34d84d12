"""Tuned schedules: the records folders (`records`), the tuner over meta_schedule (`tune`), and
a compiled model's tunable functions (`model`)."""
