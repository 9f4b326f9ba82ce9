"""brisk's own fuzz harness for model files: see harness.py."""
