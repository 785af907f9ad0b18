"""One-off GPU investigations behind the notes in ``benchmarks/NOTES.md``: each probe's docstring says what it
asks and how to run it (``python3 benchmarks/probes/probe_<name>.py ...`` from the repository root); the notes say
what it found. The benchmarks themselves are one folder up."""
