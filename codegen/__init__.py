"""Per-rank program emission, collectives, schedules, executor and launcher (later issues)."""
