"""Write the sample inputs that `fcl infer` examples in the docs read (committed beside this
script; run it again to regenerate them, the same bytes every time):

    python examples/make_inputs.py

* ``digits-rows.csv``: 5 test rows of scikit-learn's 8x8 digits, binarised as the quickstart's
  models are (value > 7): what a MADE served by the quickstart or the local fleet scores.
* ``mnist-rows.csv``: 5 MNIST test images, binarised at pixel > 127 and flattened to 784:
  what the Sequential MNIST MADE scores.
* ``mnist-images.npy``: the same 5 images as 28x28 uint8 pixels: what the image classifiers
  (FIL-VER, NGFL) classify (``fcl infer MODEL --input examples/mnist-images.npy``).
* ``texts.txt``: 3 news-like sentences, one per line, for the text classifiers (FedET, FedSeIT):
  ``fcl infer MODEL --text "$(head -1 examples/texts.txt)"``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TEXTS = [
    "Shares fell sharply after the bank reported lower profits for the quarter.",
    "The striker scored twice as the home side won the cup final.",
    "The new film opened to strong reviews and a record weekend at the box office.",
]


def main() -> None:
    from fclcore.data import load_digits, load_mnist

    _, digits = load_digits()  # binarised at value > 7, as the quickstart's scenario has it
    np.savetxt(HERE / "digits-rows.csv", digits.x[:5].astype(np.uint8), fmt="%d", delimiter=",")
    _, binary = load_mnist()
    np.savetxt(HERE / "mnist-rows.csv", binary.x[:5].astype(np.uint8), fmt="%d", delimiter=",")
    _, gray = load_mnist(threshold=None)
    np.save(HERE / "mnist-images.npy", np.round(gray.x[:5] * 255).astype(np.uint8).reshape(5, 28, 28))
    (HERE / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    print(f"wrote {', '.join(sorted(p.name for p in HERE.iterdir() if p.suffix in ('.csv', '.npy', '.txt')))}")


if __name__ == "__main__":
    main()
