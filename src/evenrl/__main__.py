from evenrl.cli import run

run()
