"""Offline analysis and output: engines, analysis, the stage table, alert evaluation, the verdict, views, the
HTML report and the log importer.  Layers 6-7 of docs/architecture.md."""
