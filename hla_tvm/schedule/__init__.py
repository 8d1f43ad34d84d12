"""Default schedules per target kind (tuned-record lookup comes with the tuning issue)."""
