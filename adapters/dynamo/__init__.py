"""The dynamo adapter."""
