"""Where admitted jobs run: `local` (torchrun child processes, the embedded default) or `kubernetes`."""
