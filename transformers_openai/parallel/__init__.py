"""Tensor parallelism: the ranks' process group and messages (`ranks`), the processes that run them (`launcher`),
and what a rank other than 0 does (`follower`)."""
