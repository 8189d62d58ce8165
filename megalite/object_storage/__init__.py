"""Object storage (docs/design.md, "Checkpoints and data in object storage"): paths.py tells
a URL from a local path and refuses the schemes megalite does not speak."""
