"""The broker process: the socket loop and the objects it hands messages to."""
