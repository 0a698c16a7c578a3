"""Tasks: offline task YAMLs over local data, task names, the bundled demo."""
