"""What training optimizes: each objective is one module behind one interface the loop calls (a
micro-batch in, its loss out; a step's metrics), and the optimizer with its learning-rate schedule
(optim.py). Next-token prediction (pretraining and SFT) is next_token.py."""
from .next_token import NextToken, evaluate
from .optim import lr_at, make_optimizer

__all__ = ["NextToken", "evaluate", "lr_at", "make_optimizer"]
