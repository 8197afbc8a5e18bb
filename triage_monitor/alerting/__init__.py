"""Alerts and trackers: rules, outcome, reference values, the alert engine, the tracker protocol and the
W&B / TensorBoard / MLflow trackers.  Layer 4 of docs/architecture.md."""
