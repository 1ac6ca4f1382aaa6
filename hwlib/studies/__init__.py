"""Side studies: each measures one question beside the ladder and returns rows and records.

``data_wait`` (share of step time spent on data), ``shapes`` (what padding a GEMM buys),
``bk_core`` (the ResNet-BK kernel grid), ``memory`` (memory techniques on a ladder step),
``batch_finder`` (the largest batch that fits).
"""
