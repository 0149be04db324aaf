"""The training loops behind `hvd-train train`: one set-up (`setup`), the fit loop (`fit`), the
elastic loop (`elastic`), and rank 0's files (`records`, `writers`)."""
