"""Pipeline schedules: the built-in names and what each needs (generators come with the schedules issue)."""
