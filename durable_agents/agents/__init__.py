"""Agents: Claude's tool-use loop as a durable step, and the participants that answer model turns."""
