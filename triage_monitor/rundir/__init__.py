"""Record path and run directory: where the bytes live (storage), every name (layout), run.json
(manifest), writer locks, file formats (blocks), the background writer (sink), the writer (records) and the
driver-side timings writer.  Layer 3 of docs/architecture.md."""
