"""Running trials: the preflight, one trial by kind, chunks of trials, local processes and Ray actors as
executors, the time left, and the files written per trial."""
