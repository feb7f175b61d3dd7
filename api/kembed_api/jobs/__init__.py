"""Jobs: submission, state machine, events, progress reports, logs."""
