"""The TRIAGE controller and loss: per-token corrections, the Gate/Repair controller, the loss assembly.
Layer 2 of docs/architecture.md."""
