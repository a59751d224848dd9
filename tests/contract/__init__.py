"""Contract suites: what every method, mode and input must satisfy."""
