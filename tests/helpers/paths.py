"""Where the checkout is, for tests that read its files (pages, scripts, committed results)."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
