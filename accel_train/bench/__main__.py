"""python -m accel_train.bench"""

from accel_train.bench.run import main

if __name__ == "__main__":
    main()
