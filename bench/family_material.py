# ruff: noqa: E501  (hand-written pairs read better one a line)
"""Hand-written material for the verifier's pair families (bench/make_verifier_families.py).

Documents, code snippets with one-token edits, instruction paraphrase groups and hand-picked pairs. Written
for this benchmark; none of it comes from the reported cases or from the QQP / banking77 data.
"""

from __future__ import annotations

DOCUMENTS = [
    "Our team spent the last quarter migrating the billing service from the old monolith to a set of "
    "smaller services. The migration took eleven weeks instead of the planned eight, mostly because the "
    "invoice generator depended on shared tables that nobody had documented. We added contract tests "
    "between the services, which caught four breaking changes before they reached production. Latency "
    "for the checkout page dropped by a third, but the nightly reconciliation job now runs twice as long "
    "and will need attention next quarter.",
    "Hi Maria, thanks for sending the draft of the venue contract. I read it over the weekend and most of "
    "it looks fine, but the cancellation clause worries me: it lets the venue keep the full deposit if we "
    "cancel less than ninety days before the event, even for reasons outside our control such as a storm. "
    "Could you ask them whether they would accept a sliding scale instead? Also, the catering section "
    "still lists the old headcount, so please update it before we sign. Best regards, Tom",
    "The city council met on Tuesday to discuss the proposal to close the riverside road to cars on "
    "weekends. Supporters argued that the change would make the area safer for cyclists and bring more "
    "visitors to the small shops along the river. Shop owners were divided: some welcomed the foot "
    "traffic, while others feared that delivery trucks would no longer reach them in time. The council "
    "agreed to run a three-month trial starting in spring and to publish traffic counts every month.",
    "Photosynthesis happens in two linked stages. In the light-dependent reactions, which take place in "
    "the thylakoid membranes, chlorophyll absorbs light and the energy is used to split water, releasing "
    "oxygen and producing the energy carriers ATP and NADPH. In the Calvin cycle, which runs in the "
    "stroma, those carriers power the fixation of carbon dioxide into sugars. The rate of the whole "
    "process depends on light intensity, the concentration of carbon dioxide and the temperature.",
    "Dear customer, we are writing to let you know that your order of a standing desk has been delayed. "
    "Our supplier informed us that the motor units are held at customs, and we now expect to ship your "
    "desk within three weeks. If you prefer not to wait, you can cancel the order from your account page "
    "and receive a full refund within five business days. As an apology, we have added a voucher for free "
    "delivery on your next purchase. We are sorry for the inconvenience.",
    "The novel follows a retired lighthouse keeper who returns to the island where he worked for thirty "
    "years after hearing that the lighthouse will be demolished. Through a series of flashbacks we learn "
    "about the shipwreck he failed to prevent, the daughter who left the island and never wrote back, and "
    "the friendship with a fisherman that kept him sane during the long winters. The ending leaves open "
    "whether he will stay on the island or finally leave it behind.",
    "Incident report: at 02:14 the primary database node stopped accepting writes after its disk filled "
    "up with write-ahead log files. The replication slot of a decommissioned replica had never been "
    "dropped, so the logs were never recycled. The on-call engineer promoted the standby at 02:41 and "
    "service recovered at 02:47. Follow-up actions: drop unused replication slots automatically, alert "
    "when the log directory passes seventy percent of the disk, and rehearse failover every month.",
    "The study recruited four hundred adults who reported sleeping less than six hours a night and "
    "randomly assigned them to either a sleep-extension program or a control group for eight weeks. "
    "Participants in the program were coached to keep a fixed bedtime and to avoid screens in the hour "
    "before sleep. They gained on average forty minutes of sleep per night and reported lower stress, "
    "although their blood pressure did not change significantly. The authors call for longer trials.",
    "Welcome to the team! During your first week you will get access to the code repository, the issue "
    "tracker and the staging environment. Please complete the security training before Friday, because "
    "production access is only granted after it. Your buddy, Priya, will pair with you on a small bug fix "
    "so that you learn the review process. Lunch on Wednesday is with the whole department, and the "
    "monthly planning meeting is the following Monday at ten.",
    "The recipe makes a dense chocolate cake without flour. Melt the chocolate and butter together over "
    "low heat, then let the mixture cool for a few minutes. Beat the eggs with the sugar until pale and "
    "thick, fold in the chocolate, and add a pinch of salt. Bake in a lined tin until the top has a thin "
    "crust but the centre still wobbles slightly. The cake sinks as it cools, which is expected, and it "
    "tastes best the next day with whipped cream.",
    "Quarterly sales in the northern region were flat compared with last year, while the southern region "
    "grew strongly thanks to two new distribution partners. Returns increased for the premium headphone "
    "line after a firmware update caused connection drops; a fix was released in the last week of the "
    "quarter. Marketing spend was cut in the west, and sales there fell slightly. Inventory levels are "
    "healthy except for the budget speakers, which are close to selling out.",
    "The hiking trail starts at the car park behind the visitor centre and climbs steadily through pine "
    "forest for the first two hours. After the wooden bridge it becomes steep and rocky, and in wet "
    "weather the stones are slippery, so good boots are essential. The summit offers views of three "
    "valleys, but the weather changes quickly and clouds often cover the top after midday. Most walkers "
    "return the same way, although a longer loop descends past the old mine.",
]

# Each group: instructions that ask for the same thing about the material above them.
INSTRUCTION_GROUPS = [
    ["Summarize this in one sentence.", "Give me a one-sentence summary of the text above.",
     "Sum up the text above in a single sentence."],
    ["Translate this into French.", "Please translate the text above into French.",
     "Can you render this text in French?"],
    ["List the key points as bullet points.", "Give me the main points as a bulleted list.",
     "Make a bullet list of the key points."],
    ["What is the tone of this text?", "How would you describe the tone of this text?",
     "Describe the tone of the passage above."],
    ["Rewrite this to be more formal.", "Make this text sound more formal.",
     "Please rephrase the passage in a more formal style."],
    ["Suggest a title for this text.", "What would be a good title for this?",
     "Propose a headline for the passage above."],
    ["Write three questions a reader might ask about this.",
     "Come up with three questions someone could ask after reading this.",
     "Give three questions a reader could have about the text."],
    ["Shorten this to half its length.", "Cut this text down to about half as long.",
     "Make this passage roughly half as long."],
    ["Fix any grammar mistakes in this text.", "Correct the grammar errors in the passage above.",
     "Please check this text for grammar mistakes and fix them."],
    ["Explain this to a ten-year-old.", "Explain the text above in words a ten year old would understand.",
     "How would you explain this to a 10-year-old child?"],
]  # fmt: skip

# (code, [one-token edits as (old, new)]); every edit changes what the code does.
CODE_SNIPPETS = [
    ("def is_adult(age):\n    return age >= 18", [(">=", ">"), ("18", "21"), ("age", "-age")]),
    ("for i in range(1, n):\n    total += values[i]", [("1, n", "0, n"), ("+=", "-="), ("values[i]", "values[i - 1]")]),
    ("if (count > max) {\n    max = count;\n}", [(">", "<"), ("max = count", "count = max")]),
    ("SELECT name FROM users WHERE age > 30 ORDER BY name ASC;", [("ASC", "DESC"), (">", "<"), ("name FROM", "email FROM")]),
    ("const total = items.reduce((sum, x) => sum + x.price, 0);", [("sum + x.price", "sum * x.price"), (", 0)", ", 1)")]),
    ("while (left < right) {\n    mid = (left + right) / 2;\n}", [("<", "<="), ("/ 2", "/ 3")]),
    ("x = [a for a in data if a % 2 == 0]", [("== 0", "== 1"), ("% 2", "% 3")]),
    ("let result = a && b || c;", [("&&", "||"), ("|| c", "&& c")]),
    ("df = df.sort_values('price', ascending=True)", [("True", "False"), ("'price'", "'date'")]),
    ("public int area() {\n    return width * height;\n}", [("*", "+"), ("height", "width")]),
    ("s = s.strip().lower()", [("lower", "upper"), ("strip", "lstrip")]),
    ("git reset --soft HEAD~1", [("--soft", "--hard"), ("HEAD~1", "HEAD~2")]),
]  # fmt: skip

CODE_QUESTION_GROUPS = [
    ["Why does this code not work?", "What is wrong with this code?", "Can you find the bug in this code?"],
    ["What does this code do?", "Explain what this code does.", "Can you explain this snippet?"],
    ["How can I make this faster?", "Can you optimize this code for speed?", "How do I speed this up?"],
    ["Add comments to this code.", "Please comment this code.", "Write comments explaining this code."],
    [
        "Write a unit test for this.",
        "Can you write a test for this code?",
        "Give me a unit test for this snippet.",
    ],
]

# (template with {q}, [(quantity, same quantity written otherwise)], [(quantity, different quantity)])
UNIT_TEMPLATES = [
    "How long does it take to walk {q}?",
    "How many calories do I burn running {q}?",
    "Is {q} a long distance for a beginner cyclist?",
    "What is the best way to carry {q} of water on a hike?",
    "How do I cook {q} of rice?",
    "Can I take {q} of ibuprofen at once?",
    "How much does it cost to ship a package of {q}?",
    "Is {q} a normal temperature for a swimming pool?",
    "How long will a phone with {q} of storage last me?",
    "Set a timer for {q}.",
]
UNIT_SAME = [
    ("5 km", "5 kilometres"), ("5 km", "5000 m"), ("3 miles", "3 mi"), ("2 kg", "2000 g"),
    ("500 ml", "0.5 l"), ("2 litres", "2 L"), ("200 mg", "200 milligrams"), ("10 lbs", "10 pounds"),
    ("30°C", "86°F"), ("64 GB", "64 gigabytes"), ("90 minutes", "1.5 hours"), ("1 kg", "1000 grams"),
]  # fmt: skip
UNIT_DIFFERENT = [
    ("5 km", "5 miles"), ("2 kg", "2 lbs"), ("500 ml", "500 l"), ("200 mg", "200 g"),
    ("30°C", "30°F"), ("64 GB", "64 MB"), ("10 minutes", "10 hours"), ("3 miles", "3 km"),
    ("1 kg", "1 g"), ("2 litres", "2 gallons"), ("45 minutes", "45 seconds"), ("10 cm", "10 inches"),
]  # fmt: skip

# Hand-written yes/no questions whose answer flips with one opposite word.
YESNO_FLIPS = [
    ("Is it safe to eat raw cookie dough?", "Is it dangerous to eat raw cookie dough?"),
    ("Is coffee good for your heart?", "Is coffee bad for your heart?"),
    ("Is it legal to record a phone call without consent in Germany?", "Is it illegal to record a phone call without consent in Germany?"),
    ("Does the stock market usually rise in December?", "Does the stock market usually fall in December?"),
    ("Is it true that goldfish have a three-second memory?", "Is it false that goldfish have a three-second memory?"),
    ("Is Rust harder to learn than Go?", "Is Rust easier to learn than Go?"),
    ("Is it healthy to skip breakfast?", "Is it unhealthy to skip breakfast?"),
    ("Should I accept the job offer if the salary is lower?", "Should I reject the job offer if the salary is lower?"),
    ("Is the water in the lake warm in June?", "Is the water in the lake cold in June?"),
    ("Are electric cars cheaper to maintain than petrol cars?", "Are electric cars more expensive to maintain than petrol cars?"),
    ("Is it wise to pay off my mortgage early?", "Is it foolish to pay off my mortgage early?"),
    ("Do cats like being picked up?", "Do cats dislike being picked up?"),
    ("Is the museum open on public holidays?", "Is the museum closed on public holidays?"),
    ("Is it possible to grow tomatoes indoors in winter?", "Is it impossible to grow tomatoes indoors in winter?"),
    ("Is a higher credit score better for a loan?", "Is a lower credit score better for a loan?"),
    ("Did the population of Tokyo increase last decade?", "Did the population of Tokyo decrease last decade?"),
    ("Is it normal for a puppy to sleep a lot?", "Is it abnormal for a puppy to sleep a lot?"),
    ("Is the new update compatible with Windows 10?", "Is the new update incompatible with Windows 10?"),
    ("Is it polite to tip in Japan?", "Is it rude to tip in Japan?"),
    ("Does stretching before running help prevent injuries?", "Does stretching before running cause injuries?"),
]  # fmt: skip

YESNO_TEMPLATE_ADJ = [("safe", "dangerous"), ("healthy", "unhealthy"), ("legal", "illegal"),
                      ("easy", "hard"), ("cheap", "expensive"), ("common", "rare")]  # fmt: skip
YESNO_TEMPLATE_ACTS = ["to swim after eating", "to drink tap water in Lisbon", "to run every day",
                       "to fly a drone in a city park", "to learn two languages at once",
                       "to keep a rabbit in an apartment"]  # fmt: skip

# Device and state commands: (action, its opposite, a paraphrase of the action).
DEVICE_ACTIONS = [
    ("turn on the {d}", "turn off the {d}", "switch on the {d}"),
    ("please switch on the {d}", "please switch off the {d}", "could you turn the {d} on"),
    ("increase the volume on the {d}", "decrease the volume on the {d}", "raise the volume on the {d}"),
    ("turn the {d} volume up", "turn the {d} volume down", "make the {d} louder"),
    ("lock the {d}", "unlock the {d}", "make sure the {d} is locked"),
    ("open the {d}", "close the {d}", "can you open the {d}"),
    ("start the {d}", "stop the {d}", "get the {d} started"),
    ("mute the {d}", "unmute the {d}", "silence the {d}"),
    ("enable the {d}", "disable the {d}", "activate the {d}"),
    ("connect the {d} to wifi", "disconnect the {d} from wifi", "hook the {d} up to the wifi"),
]  # fmt: skip
DEVICES = ["kitchen lights", "living room speaker", "garage door", "front door", "bedroom fan", "tv",
           "dishwasher", "thermostat", "smart plug", "robot vacuum"]  # fmt: skip

PARAPHRASES = [
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the capital of Australia?", "Which city is the capital of Australia?"),
    ("How do I make a good cup of coffee?", "What's the best way to make a good cup of coffee?"),
    ("Why is the sky blue?", "What makes the sky blue?"),
    ("How can I improve my sleep?", "What can I do to sleep better?"),
    ("What are some tips for learning guitar?", "Can you give me tips for learning the guitar?"),
    ("How do I remove a stripped screw?", "What is the best way to get a stripped screw out?"),
    ("What causes inflation?", "What are the causes of inflation?"),
    ("How do I cancel my subscription?", "How can I cancel my subscription?"),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"),
    ("How do I clean a cast iron pan?", "What's the right way to clean a cast iron pan?"),
    ("What is the difference between a virus and a bacterium?", "How is a virus different from a bacterium?"),
    ("How do I center a div in CSS?", "How can I center a div with CSS?"),
    ("What should I pack for a week in Iceland?", "What do I need to pack for a week-long trip to Iceland?"),
    ("How do I change a flat tire?", "How can I change a flat tyre?"),
    ("What is a good name for a golden retriever?", "Can you suggest a good name for a golden retriever?"),
    ("How does compound interest work?", "Can you explain how compound interest works?"),
    ("How do I get rid of fruit flies?", "What's the best way to get rid of fruit flies?"),
    ("Where does the word 'salary' come from?", "What is the origin of the word 'salary'?"),
    ("How do I write a cover letter?", "How should I write a cover letter?"),
    ("What are the symptoms of dehydration?", "What are signs of dehydration?"),
    ("How do I stop my cat from scratching furniture?", "How can I keep my cat from scratching the furniture?"),
    ("What is the tallest mountain in Africa?", "Which mountain is the highest in Africa?"),
    ("How do I convert a list to a string in Python?", "How can I turn a list into a string in Python?"),
    ("Can you recommend a good science fiction book?", "What is a good science fiction book to read?"),
    ("How do I back up my iPhone?", "How can I back up my iPhone?"),
    ("What is the best way to learn Spanish?", "What's the most effective way to learn Spanish?"),
    ("How do I boil an egg?", "How should I boil an egg?"),
    ("Why do onions make you cry?", "What makes people cry when cutting onions?"),
    ("How long should I rest between sets at the gym?", "How much rest should I take between sets at the gym?"),
    ("What is machine learning?", "Can you explain what machine learning is?"),
    ("How do I unclog a drain?", "What's the best way to unclog a drain?"),
    ("Summarize the plot of Hamlet.", "Give me a summary of the plot of Hamlet."),
    ("Write a haiku about autumn.", "Compose a haiku about autumn."),
    ("What time zone is Chicago in?", "Which time zone is Chicago in?"),
    ("How do I delete my Facebook account?", "How can I delete my Facebook account?"),
]  # fmt: skip

# Instructions and a near miss: one or two words changed, and another answer is wanted.
NEAR_MISS_INSTRUCTIONS = [
    ("Translate this into French.", "Translate this into German."),
    ("Translate this into Spanish.", "Translate this into Portuguese."),
    ("Rewrite this to be more formal.", "Rewrite this to be more casual."),
    ("List the key points as bullet points.", "List the open questions as bullet points."),
    ("What is the tone of this text?", "What is the purpose of this text?"),
    ("Suggest a title for this text.", "Suggest a tagline for this text."),
    ("Fix any grammar mistakes in this text.", "Fix any spelling mistakes in this text."),
    ("Explain this to a ten-year-old.", "Explain this to a lawyer."),
    ("Shorten this to half its length.", "Expand this to twice its length."),
    ("Write three questions a reader might ask about this.", "Write three tweets about this."),
    ("Who is the intended audience of this text?", "Who is the likely author of this text?"),
    ("Make this text shorter.", "Make this text longer."),
    ("Extract all the dates mentioned.", "Extract all the names mentioned."),
    ("Write a reply agreeing to the proposal.", "Write a reply declining the proposal."),
    ("What is the main argument?", "What is the main weakness?"),
    ("Summarize this for a manager.", "Summarize this for a customer."),
]
CODE_NEAR_MISS_QUESTIONS = [
    ("Why does this code not work?", "Why is this code so slow?"),
    ("Convert this to JavaScript.", "Convert this to TypeScript."),
    ("Add type hints to this code.", "Add docstrings to this code."),
    ("Write a unit test for this.", "Write documentation for this."),
    ("Explain what this code does.", "Explain what this code costs in memory."),
    ("Rewrite this in Go.", "Rewrite this in Rust."),
]

# Light rewordings of an instruction, as a user re-asks: the same words mostly, another form.
REWORDED_INSTRUCTIONS = [
    ("Summarize this in one sentence.", "Summarise this in one sentence please."),
    ("Translate this into French.", "Please translate this into French."),
    ("List the key points as bullet points.", "list the key points as bullets"),
    ("What is the tone of this text?", "What's the tone of this text?"),
    ("Rewrite this to be more formal.", "Can you rewrite this to be more formal?"),
    ("Suggest a title for this text.", "Suggest a good title for this text."),
    ("Fix any grammar mistakes in this text.", "Fix the grammar mistakes in this text."),
    ("Explain this to a ten-year-old.", "Explain this to a 10-year-old."),
    ("What is the main argument?", "What's the main argument here?"),
    ("Extract all the dates mentioned.", "Extract all dates that are mentioned."),
    ("Who is the intended audience of this text?", "Who is this text's intended audience?"),
    ("Write a reply agreeing to the proposal.", "Write a reply that agrees to the proposal."),
    ("Make this text shorter.", "Please make this text shorter."),
    ("What are the next steps?", "What are the next steps here?"),
    ("Give me three follow-up questions.", "Give three follow-up questions."),
    ("Summarize this for a manager.", "Summarize this for my manager."),
]
REWORDED_CODE_QUESTIONS = [
    ("Why does this code not work?", "Why doesn't this code work?"),
    ("What does this code do?", "What does this code do exactly?"),
    ("How can I make this faster?", "How can I make this code faster?"),
    ("Add comments to this code.", "Please add comments to this code."),
    ("Write a unit test for this.", "Write a unit test for this function."),
    ("Explain this code.", "Explain this code to me."),
    ("Is there a bug here?", "Is there a bug in here?"),
    ("Convert this to JavaScript.", "Convert this code to JavaScript."),
]
