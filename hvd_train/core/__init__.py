"""The framework-free core: config, launcher environment, batch and learning-rate rules, launch
commands, placement rules, faults (signals, watchdog, exit codes, job status), consistency guards,
the checkpoint format and the run directory.

Nothing here imports TensorFlow, Keras or Horovod (import-linter checks), so all of it is
unit-tested in one process and the CLI checks its input before paying for them.
"""
