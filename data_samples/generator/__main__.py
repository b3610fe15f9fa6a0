"""Regenerate the shipped samples byte for byte: `python data_samples/generator [--out DIR]` (default: data_samples/).

The corpus and the Alpaca records come from seeded templates (sample_corpus.py); the tokenizer is trained on them
(sample_tokenizer.py). tests/test_samples.py checks that the shipped files are what this writes.
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the checkout: kit/

if __name__ == "__main__":
    from sample_corpus import write_samples
    from sample_tokenizer import sample_texts, train_sample_tokenizer

    parser = argparse.ArgumentParser(
        prog="python data_samples/generator", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default=str(HERE.parent), help="folder (default: data_samples/)")
    out = parser.parse_args().out
    paths = write_samples(out)
    paths["tokenizer"] = train_sample_tokenizer(sample_texts(), f"{out}/tokenizer")
    for name, path in paths.items():
        print(f"{name}: {path}")
