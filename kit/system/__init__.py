"""The machine: accelerator choice, CANN, library versions and their differences, child processes."""
