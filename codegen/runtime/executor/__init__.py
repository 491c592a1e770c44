"""Running one pipeline rank's schedule: the executor, point-to-point messages, the split backward, the schedule's
checker and simulator, adaptive injection."""
