"""Table kinds' trainer halves, one module each (`kembed_trainer.kinds` finds them by name): how the tables of
one width and kind are held and looked up. `base` says what a kind answers."""
