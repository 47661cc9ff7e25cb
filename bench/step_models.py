"""The gradient shapes of one training step of real models, for bench/step_allreduce.py.

- resnet50: the 214 trainable tensors of keras.applications.ResNet50(weights=None),
  in the model's own order (25,583,592 float32, 102 MB); `python bench/step_models.py
  --check` compares them with Keras.
- bert_base: BERT-base (uncased vocabulary), 199 tensors incl. the 30522 x 768 word
  embedding (109,482,240 float32, 438 MB), in the order of the HuggingFace model.
- dense100: the model of issue 28: 100 x Dense(500) after a 500-wide input, then
  Dense(10): 202 tensors, 25,055,010 float32 (100 MB); its TensorFlow step is timed
  beside it.
"""
from __future__ import annotations

import math
import sys
from typing import Dict, List, Tuple

Shape = Tuple[int, ...]


def resnet50() -> List[Shape]:
    s: List[Shape] = [(7, 7, 3, 64), (64,), (64,), (64,)]
    cin = 64
    for f, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = 4 * f
        # the first block's shortcut (0_conv) comes after 2_conv, its BN after 3_conv
        s += [(1, 1, cin, f), (f,), (f,), (f,), (3, 3, f, f), (f,), (f,), (f,),
              (1, 1, cin, out), (out,), (1, 1, f, out), (out,), (out,), (out,), (out,), (out,)]
        for _ in range(blocks - 1):
            s += [(1, 1, out, f), (f,), (f,), (f,), (3, 3, f, f), (f,), (f,), (f,),
                  (1, 1, f, out), (out,), (out,), (out,)]
        cin = out
    return s + [(2048, 1000), (1000,)]


def bert_base(vocab: int = 30522, hidden: int = 768, layers: int = 12, inner: int = 3072,
              positions: int = 512) -> List[Shape]:
    h = hidden
    s: List[Shape] = [(vocab, h), (positions, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        s += [(h, h), (h,)] * 4  # query, key, value, attention output
        s += [(h,), (h,), (h, inner), (inner,), (inner, h), (h,), (h,), (h,)]
    return s + [(h, h), (h,)]  # pooler


def dense100(width: int = 500, layers: int = 100, classes: int = 10) -> List[Shape]:
    return [(width, width), (width,)] * layers + [(width, classes), (classes,)]


def models(tiny: bool = False) -> Dict[str, List[Shape]]:
    """Every model's shapes; tiny: the same tensors with every dimension divided by 8
    (the same number of tensors, a few hundred KB)."""
    out = {"resnet50": resnet50(), "bert_base": bert_base(), "dense100": dense100()}
    if tiny:
        out = {k: [tuple(max(1, d // 8) for d in shape) for shape in v] for k, v in out.items()}
    return out


def elements(shapes: List[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)


def _check() -> int:
    import keras
    import numpy as np
    theirs = [tuple(w.shape) for w in keras.applications.ResNet50(weights=None).trainable_weights]
    ok = theirs == resnet50()
    print(f"resnet50: {len(theirs)} tensors, {sum(int(np.prod(s)) for s in theirs)} elements in "
          f"Keras; {'same' if ok else 'DIFFERENT'} shapes here")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(_check())
    for name, shapes in models().items():
        print(f"{name}: {len(shapes)} tensors, {elements(shapes)} elements")
