"""The contracts between stages: configs, manifests, the workspace, the input finder, known errors."""
