"""Write the offline assets the stock example scripts read: a locally trained tokenizer, a tiny Llama config and
train/validation text files (the text ships with the package).

    python examples/make_tiny_assets.py /tmp/tiny [--hidden_size 64] [--num_hidden_layers 2]
"""

import argparse

from accelerate_roundpipe.tiny.data import write_assets


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_hidden_layers", type=int, default=2)
    args = parser.parse_args()
    print(write_assets(args.directory, args.hidden_size, args.num_hidden_layers))


if __name__ == "__main__":
    main()
