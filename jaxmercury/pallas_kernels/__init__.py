"""Local kernels that ``Schedule.patch`` can put in place of a program's body."""
