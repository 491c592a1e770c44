"""Analysis, decision and rewrite passes, one file each."""
