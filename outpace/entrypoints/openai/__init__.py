"""entrypoints/openai"""
