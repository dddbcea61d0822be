"""Helper programs of the adversarial tests (run as child processes)."""
