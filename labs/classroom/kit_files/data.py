"""The offline data the lab reads (given): MNIST-style IDX files, md5-checked, as tensors.

Fashion-MNIST comes from Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist);
MNIST needs --data-dir. train_samples / test_samples keep the first N images (quick runs).
"""
from torch.utils.data import TensorDataset

from labs.kit.data import load_dataset


def load(dataset="fashion-mnist", data_dir=None, train_samples=None, test_samples=None):
    """(train, test) TensorDatasets of normalised 1x28x28 images and int64 labels."""
    data = load_dataset(dataset, data_dir)
    train = TensorDataset(data.train_x[:train_samples], data.train_y[:train_samples])
    test = TensorDataset(data.test_x[:test_samples], data.test_y[:test_samples])
    return train, test
