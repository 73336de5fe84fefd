from train.rl.command import main

main()
