"""Searches and what they apply each step: greedy/beam/sampling, processors, top-k, log-softmax, settings, stopping, the n-gram reference.  They know no runtime."""
