"""ddptrain: multi-node DistributedDataParallel training for PyTorch.

The Python API (the same run `ddptrain train` makes, from a script, a notebook or your own launcher):

    from ddptrain import Config, train
    result = train({"train": {"max_steps": 100}}, model=my_module, datasets=(train_set, val_set))
    print(result.step, result.loss, result.run_dir)

Run the script as one process, or under `torchrun --nproc-per-node N script.py` for N ranks.
"""

from ddptrain.config import Config, load_config
from ddptrain.errors import DdptrainError, UserError
from ddptrain.run import RunResult, train
from ddptrain.train.hooks import TrainingHook

__all__ = ["Config", "DdptrainError", "RunResult", "TrainingHook", "UserError", "load_config", "train"]
__version__ = "0.1.0"
