"""A fixed English text the tiny models' tokenizer is trained on.

Changing it changes every tiny model's tokenizer (and so its ids); don't.
"""

TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day.
Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.
What is the capital of France? The capital of France is Paris.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Once upon a time there was a little girl who lived in a village near the forest.
She liked to read books, to walk in the garden and to watch the birds in the trees.
One morning she found a small cat under the old wooden bridge by the river.
The cat was cold and hungry, so she carried it home and gave it some warm milk.
From that day on, the cat followed her everywhere she went.
A computer is a machine that can store and process information very quickly.
Programs tell the computer what to do, one instruction after another.
Python is a programming language that many people use to write programs.
The server receives a request, runs the model, and sends the answer back to the client.
Large language models predict the next token of a text, one token at a time.
Water boils at one hundred degrees and freezes at zero degrees.
The sun rises in the east and sets in the west. The moon shines at night.
There are seven days in a week and twelve months in a year.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
January, February, March, April, May, June, July, August, September, October, November, December.
One, two, three, four, five, six, seven, eight, nine, ten.
0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14
Please write a short story about a robot who learns to paint.
Can you explain how the weather changes during the year?
The teacher asked the students to open their books and read the first page.
Good morning, good evening, good night. Thank you very much. You are welcome.
People travel by car, by train, by bus, by plane and sometimes by boat.
The market sells apples, oranges, bread, cheese, fish and fresh vegetables.
He opened the window, looked at the sky and decided to go for a long walk.
It was a bright cold day in April, and the clocks were striking thirteen.
All happy families are alike; each unhappy family is unhappy in its own way.
def add(a, b):
    return a + b
for i in range(10):
    print(i)
{"name": "ferry", "role": "assistant", "content": "Hello, world!"}
"""
