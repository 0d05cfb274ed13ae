"""Data loaders: the checked download cache, Banana, the UCI sets and CIFAR-10 as arrays."""
