"""``ascend-eplb simulate``: real routing replayed across EP rank processes through every plane."""
