"""The built-in recipes, one package each; pan/recipe.py finds them (nothing here imports them)."""
