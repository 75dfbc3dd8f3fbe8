"""Reading the prompt dataset (readers): files, columns and rows checked without torch, shared by the trainer and
the planner. Imports nothing of evenrl but `errors`."""
