#!/usr/bin/env python3
"""Build data/prompts/train.jsonl: self-distillation prompts for the DFlash drafter.

Deterministic (seeded, no network, stdlib only). Every prompt comes from the
hand-written lists and templates below; random choices only pick and combine
them and draw numbers for the math problems. The script refuses to write a
prompt that equals, or nearly equals, one in eval.jsonl (see near_duplicate).

    python data/prompts/make_train_prompts.py            # writes train.jsonl
    python data/prompts/make_train_prompts.py --check    # regenerate, compare
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import re
import sys

SEED = 20261129
HERE = pathlib.Path(__file__).resolve().parent
# Roughly half chat, since open-ended chat is the serving workload; the other
# three categories mirror eval.jsonl so the drafter sees each kind of text.
COUNTS = {"chat": 3000, "math": 1000, "code": 1000, "summarization": 1000}

# A few eval.jsonl subjects, kept out of the train topic lists entirely; the
# assertion at the end guards against someone adding them back.
EVAL_ONLY_PHRASES = ["water cycle", "coral reef", "honeybee", "printing press",
                     "penny-farthing", "sky blue", "leaves change color",
                     "virus and a bacterium", "fizzbuzz", "palindrome"]

SYSTEM_PROMPTS = [
    "You are a friendly assistant who gives short, clear answers.",
    "You are a helpful tutor for middle-school students.",
    "You are a patient teacher. Explain things step by step.",
    "You are a concise assistant. Answer in three sentences or fewer.",
    "You are a helpful assistant.",
    "You are a cheerful assistant who explains things with simple examples.",
]
SYSTEM_PROB = 0.08

# ---------------------------------------------------------------- topics ---
SCIENCE = """photosynthesis | gravity | black holes | the periodic table | DNA |
plate tectonics | volcanoes | earthquakes | the solar system | the phases of the moon |
magnetism | electricity | static electricity | sound waves | rainbows | the human heart |
the immune system | evolution by natural selection | the structure of a cell |
atoms and molecules | chemical reactions | acids and bases | ocean tides | the speed of light |
friction | fossils | dinosaurs | the Big Bang | how stars form | comets | the northern lights |
lightning | the human brain | the digestive system | the human skeleton | genes and heredity |
gut bacteria | renewable energy | nuclear power | solar panels | batteries | the nitrogen cycle |
food chains | ecosystems | the ozone layer | microscopes | telescopes | the states of matter |
density | buoyancy | clouds | hurricanes | tornadoes | glaciers | deserts | rainforests |
the carbon cycle | antibiotics | the lungs | blood types | the Mars rovers |
the International Space Station | exoplanets | the Doppler effect | electric circuits |
lenses and light | erosion | the rock cycle | mushrooms and fungi | seeds and germination |
the life cycle of a butterfly | wetlands | ocean currents | the metric system"""

HISTORY_EVENTS = """the building of the pyramids of Giza | the Roman Empire | ancient Greece |
the ancient Olympic Games | the Silk Road | the Viking Age | the Middle Ages in Europe |
medieval castles | the Black Death | the Renaissance | the Age of Exploration |
the Aztec Empire | the Inca Empire | the Maya civilization | the Industrial Revolution |
the invention of the steam engine | the American Revolution | the French Revolution |
the abolition of slavery | the Wright brothers' first flight | World War I | World War II |
the Great Depression | the civil rights movement | the Cold War | the Moon landing in 1969 |
the fall of the Berlin Wall | the invention of the telephone | the invention of the light bulb |
the history of the internet | the Great Wall of China | the Ottoman Empire |
the samurai of Japan | the sinking of the Titanic | the California Gold Rush |
the building of the Panama Canal | the Magna Carta | the Ming dynasty | the Hanseatic League |
the first transatlantic telegraph cable | the history of the Olympic marathon |
the invention of paper in China | the Library of Alexandria | the Trojan War legend |
the Battle of Hastings | the history of chocolate | the history of coffee | the Apollo program"""

HISTORY_PEOPLE = """Leonardo da Vinci | Marie Curie | Isaac Newton | Albert Einstein | Cleopatra |
Genghis Khan | Mahatma Gandhi | Nelson Mandela | Ada Lovelace | Charles Darwin | Galileo Galilei |
William Shakespeare | Wolfgang Amadeus Mozart | Ludwig van Beethoven | Frida Kahlo |
Vincent van Gogh | Florence Nightingale | Abraham Lincoln | Harriet Tubman | Martin Luther King Jr. |
Julius Caesar | Alexander the Great | Confucius | Joan of Arc | Nikola Tesla | Thomas Edison |
Amelia Earhart | Neil Armstrong | Rosalind Franklin | Alan Turing | Jane Austen |
Marco Polo | Queen Victoria | Napoleon Bonaparte | Ibn Battuta | Hypatia of Alexandria |
Louis Pasteur | Grace Hopper | Katherine Johnson | Pablo Picasso"""

PLACES = """Japan | Brazil | Canada | Kenya | Egypt | India | Australia | Norway | Mexico | Peru |
Italy | Spain | Germany | Vietnam | Morocco | Iceland | New Zealand | Argentina | South Korea |
Thailand | Greece | Turkey | Portugal | Ireland | Chile | Indonesia | Nigeria | Ghana |
Switzerland | the Netherlands | Poland | Sweden | Scotland | Cuba | Nepal | Mongolia |
the Amazon River | the Sahara Desert | the Himalayas | the Nile | the Alps | Mount Everest |
the Grand Canyon | the Pacific Ocean | Antarctica | the Mediterranean Sea | the Rocky Mountains |
Lake Baikal | the Dead Sea | Yellowstone National Park | Madagascar | the Galapagos Islands |
Finland | Colombia | Ethiopia | Tanzania | the Philippines | Bhutan | Jordan | Croatia"""

CITIES = """Rome | Tokyo | Kyoto | Barcelona | Lisbon | London | Edinburgh | New York City |
San Francisco | Chicago | New Orleans | Mexico City | Buenos Aires | Rio de Janeiro |
Cape Town | Marrakech | Cairo | Istanbul | Athens | Prague | Vienna | Budapest | Amsterdam |
Copenhagen | Stockholm | Berlin | Dublin | Reykjavik | Bangkok | Hanoi | Singapore | Seoul |
Sydney | Melbourne | Vancouver | Montreal | Lima | Cusco | Dubai | Mumbai | Bali | Paris |
Florence | Venice | Seville | Porto | Krakow | Oslo | Helsinki | Toronto | Boston | Washington, D.C. |
Havana | Hong Kong | Taipei | Kathmandu | Zanzibar | Queenstown"""

DISHES = """pancakes | scrambled eggs | an omelette | French toast | banana bread |
chocolate chip cookies | a simple tomato sauce | spaghetti carbonara | vegetable soup |
chicken noodle soup | lentil soup | fried rice | a vegetable stir-fry | guacamole | hummus |
a Greek salad | a Caesar salad | homemade pizza | a loaf of bread | a grilled cheese sandwich |
mashed potatoes | roasted vegetables | vegetarian chili | fish tacos | pad thai |
a chickpea curry | mushroom risotto | a fruit smoothie | overnight oats | lemonade |
apple pie | brownies | a simple vanilla cake | pesto pasta | baked salmon | roast chicken |
a bean burrito | miso soup | potato salad | coleslaw | homemade granola | a yogurt parfait |
pumpkin soup | shakshuka | a tuna sandwich | lemon bars | chicken fajitas | a veggie burger |
dumplings | sushi rolls at home | a quiche | oatmeal cookies | a cheese omelette with spinach |
gazpacho | ratatouille | rice pudding | fried plantains | a lentil salad | teriyaki chicken"""

COOKING_QUESTIONS = """What is the difference between baking soda and baking powder? |
Why does bread dough need to rise? | How do I sharpen a kitchen knife safely? |
How should I store fresh herbs so they last longer? | How do I cook rice so it doesn't stick? |
How can I tell if an egg is still fresh? | What is umami? |
How do I season a cast iron pan? | How can I reduce food waste at home? |
How do I caramelize onions? | What is the difference between boiling and simmering? |
How do I know when chicken is fully cooked? | What spices should every beginner have in the kitchen? |
How can I make a salad more filling? | What can I use instead of eggs in baking? |
How do I keep avocados from turning brown? | Why do recipes say to rest meat after cooking? |
What does it mean to fold ingredients together? | How do I make soup less salty? |
What are some easy meals I can cook in one pot? | How do I plan meals for a week on a small budget? |
What is the best way to reheat leftover pizza? | How long can cooked rice stay in the fridge? |
What kitchen tools does a beginner really need? | How do I make fluffy pancakes? |
Why does my cake sink in the middle? | How can I make vegetables taste better for kids?"""

HEALTH_GOALS = """drinking more water | eating more vegetables | cutting down on sugar |
improving posture at a desk | stretching after exercise | staying active while working from home |
managing stress | handling exam anxiety | daily dental care | sun protection for the skin |
building a healthy morning routine | walking more every day | starting strength training at home |
choosing healthy snacks | reducing screen time | taking breaks from the computer |
staying hydrated in hot weather | avoiding colds in winter | reducing eye strain |
eating a healthy breakfast | meditating as a beginner | practicing deep breathing |
cooking healthy meals on a budget | eating less fast food | staying fit while traveling |
keeping a healthy back | improving balance as you get older | drinking less coffee |
building a regular exercise habit | doing yoga at home"""

HEALTH_TOPICS = """calories | vitamins | vitamin D | protein in the diet | dietary fiber | cholesterol |
blood pressure | dehydration | seasonal allergies | colds and the flu |
basic first aid | sprained ankles | how the lungs work |
the benefits of walking | the importance of a balanced diet | how muscles grow |
why we get fevers | how the kidneys work | iron deficiency | food poisoning |
the benefits of stretching | why sunscreen matters | heart rate | hand washing"""

TECH = """algorithms | how the internet works | how email works | web browsers | cloud computing |
artificial intelligence | machine learning | search engines | password managers |
two-factor authentication | phishing emails | computer viruses | encryption | operating systems |
the difference between RAM and storage | GPS | Wi-Fi | Bluetooth | QR codes | barcodes |
3D printing | robots | self-driving cars | blockchain | open-source software | version control with Git |
APIs | databases | spreadsheets | binary numbers | pixels and screen resolution |
touchscreens | electric cars | recycling old electronics | website cookies | backing up your files |
smart speakers | video compression | how computer memory works | USB cables |
programming languages | the history of video games | social media algorithms | digital cameras"""

ARTS = """jazz | classical music | poetry | haiku | Shakespeare's plays | the modern Olympic Games | opera |
the Mona Lisa | comic books | street art | hip-hop music | folk tales | the history of the piano | theater |
Greek mythology | fairy tales | the Beatles | Impressionist painting | the Oscars | animated films |
the FIFA World Cup | graphic design | architecture | museums"""

HOBBIES = """the guitar | the piano | drawing | watercolor painting | photography | chess | soccer | basketball |
tennis | swimming | yoga | skateboarding | rock climbing | origami | knitting | pottery | board games |
the violin | calligraphy | baseball | cricket | table tennis | gardening | bird watching | sign language |
film-making | ballet | baking bread | woodworking | juggling | creative writing | salsa dancing"""

ANIMALS = """elephants | octopuses | penguins | dolphins | wolves | owls | cats | dogs | butterflies |
ants | sharks | whales | kangaroos | giraffes | parrots | frogs | bats | spiders | horses | tigers |
polar bears | hummingbirds | sea turtles | salmon | camels | koalas | crows | jellyfish | bears |
squirrels | rabbits | chimpanzees | cheetahs | flamingos | eagles | snails | earthworms | seahorses"""

SOCIETY = """inflation | interest rates | credit cards | saving for retirement | compound interest |
supply and demand | taxes | the stock market | starting a small business | recycling |
public transportation | democracy | the United Nations | volunteering | city planning |
libraries | minimum wage | insurance | online shopping | renting an apartment |
the sharing economy | fair trade | local elections | international trade | freelancing"""

def split(s: str) -> list[str]:
    return [x.strip() for x in s.replace("\n", " ").split("|") if x.strip()]

GENERIC_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Can you explain {t} to a ten-year-old?",
    "Tell me about {t}.",
    "What are three interesting facts about {t}?",
    "Give me a short overview of {t}.",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "What are some common misconceptions about {t}?",
    "Write a paragraph about {t} for a school report.",
    "List five key words related to {t} and explain each one briefly.",
    "I'm curious about {t}. Where should I start if I want to learn more?",
    "Summarize what you know about {t} in three bullet points.",
    "What questions might a student ask about {t}? List a few and answer them.",
    "Describe {t} in exactly three sentences.",
    "What is the most surprising thing about {t}?",
]
WHY_TEMPLATES = [
    "Why is {t} important?",
    "How does {t} affect our daily lives?",
    "What would happen if we didn't understand {t}?",
]

HISTORY_EVENT_TEMPLATES = [
    "What was {t}?", "Why was {t} important?", "Tell me about {t}.",
    "What were the main causes and effects of {t}?",
    "Explain {t} in a few paragraphs for a high-school student.",
    "Give me a short timeline of {t}.",
    "What can we learn today from {t}?",
]
PEOPLE_TEMPLATES = [
    "Who was {t}?", "What is {t} best known for?", "Write a short biography of {t}.",
    "Imagine you could interview {t}. What three questions would you ask, and how might they answer?",
    "Why is {t} still remembered today?",
    "Tell me three interesting facts about {t}.",
    "Write a short poem in honor of {t}.",
]
PLACE_TEMPLATES = [
    "Tell me about {t}.", "What is the climate like in {t}?", "What is {t} famous for?",
    "Give me five facts about {t}.", "Describe the geography of {t}.",
    "What animals and plants can be found in {t}?",
    "Write a short travel guide introduction for {t}.",
]
CITY_TEMPLATES = [
    "What are the top things to see in {t}?",
    "Plan a {n}-day trip to {t}.",
    "What is the best time of year to visit {t}?",
    "Give me tips for visiting {t} on a budget.",
    "What local foods should I try in {t}?",
    "Write a short postcard message to a friend from {t}.",
    "How should I get around {t} as a tourist?",
    "What should I pack for a trip to {t} in {season}?",
    "I have one free afternoon in {t}. What should I do?",
    "What are some good day trips from {t}?",
]
DISH_TEMPLATES = [
    "How do I make {t}?", "Give me a simple recipe for {t}.",
    "What ingredients do I need for {t}?", "What side dishes go well with {t}?",
    "How can I make {t} healthier?",
    "I've never cooked before. Walk me through making {t} step by step.",
    "What are common mistakes people make when cooking {t}?",
    "Write a short, funny poem about {t}.",
    "How can I make {t} for a group of {n} people?",
]
HEALTH_GOAL_TEMPLATES = [
    "Give me some tips for {t}.", "How can I get better at {t}?",
    "What are the benefits of {t}?", "Make a simple one-week plan for {t}.",
    "My friend keeps struggling with {t}. What advice could I give them?",
    "What are small, easy first steps for {t}?",
]
TECH_TEMPLATES = [
    "How does {t} work?", "Explain {t} to someone who isn't good with computers.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short paragraph explaining {t} for a newsletter.",
]
ANIMAL_TEMPLATES = [
    "Tell me some fun facts about {t}.", "Where do {t} live and what do they eat?",
    "How do {t} communicate?", "Write a short children's story about {t}.",
    "How do {t} take care of their young?", "Write a haiku about {t}.",
    "What makes {t} unique compared to other animals?",
]
HOBBY_TEMPLATES = [
    "How can a beginner get started with {t}?", "What is the history of {t}?",
    "What do I need to get started with {t}?", "Why do people enjoy {t}?",
    "Give me a four-week plan to learn the basics of {t}.",
]

CURIOUS = """Why do cats purr? | How do airplanes stay in the air? | Why is the ocean salty? |
How do birds know where to migrate? | Why do we have seasons? | How does a refrigerator keep food cold? |
Why do we yawn? | How do fish breathe underwater? | Why do we have fingerprints? |
How does a rainbow form? | Why does ice float on water? | 
Why do stars twinkle? | How do magnets work? | Why do we get goosebumps? |
How does soap clean things? | Why do our ears pop on an airplane? | How do plants drink water? |
Why do some people need glasses? | How does a compass work? | Why is grass green? |
How do volcanoes erupt? | Why do we hiccup? | How does a microwave oven heat food? |
Why does the moon change shape? | How do chameleons change color? | Why do dogs wag their tails? |
How does a camera take a picture? | How do submarines dive and surface? |
Why does bread go stale? | How do hot air balloons fly? | Why do cuts heal? |
How do owls see at night? | Why does thunder come after lightning? | How is glass made? |
Why do apples turn brown after you cut them? | How do trains stay on the tracks? |
How do spiders make webs? | Why is the Dead Sea so salty? |
How does a thermometer work? | Why do boats float? | How are rainbows different from halos? |
Why do zebras have stripes? | How do earthquakes happen? | Why are flamingos pink? |
How does a bicycle stay upright when it's moving? | Why do we have different time zones? |
How do noise-cancelling headphones work? | Why does metal feel colder than wood? |
How do plants know which way is up? | Why do some animals hibernate? | How does a solar panel make electricity? |
Why is it hotter near the equator? | How do glow sticks work? | Why do onions make people cry? |
Why do leap years exist? | How does recycling paper work? |
Why do some trees lose their needles and others don't? | How is chocolate made? |
Why do people have different blood types? | How does an elevator work? |
Why do tomatoes count as fruit? | How do whales sleep? | Why does popcorn pop? |
How do pilots navigate at night? | Why do we sneeze? | How does a lock and key work? |
Why do mosquitoes bite some people more than others? | How do clouds float? |
Why do we see lightning before we hear thunder? | How does a battery store energy? |
Why is the Earth round? | How do ants find their way home? | Why does a kettle whistle? |
How does a toilet flush work? | Why are there so many languages in the world? |
How do credit card payments work? | Why do we celebrate birthdays? | How do tides rise and fall? |
Why does the sun look red at sunset? | How do cactuses survive in the desert? |
How do seeds know when to sprout? | Why do some metals rust? | How does a piano make sound? |
Why do we have two eyes instead of one? | How do octopuses change their skin texture? |
Why does hot water sometimes freeze faster than cold water? | How are mountains formed? |
Why do cats always land on their feet? | How does a smartphone know which way it is facing? |
How do we know how old the Earth is? | Why do ships leave white trails in the water? |
How do satellites stay in orbit? | Why does our voice sound different on a recording?"""

COMPARE = """cats and dogs as pets | tea and coffee | city life and country life |
reading books and watching movies | renting and buying a home | trains and planes for travel |
summer and winter | crocodiles and alligators | weather and climate | a lake and a pond |
weather forecasts and climate predictions | e-books and paper books | online classes and classroom classes |
walking and running for exercise | butter and olive oil for cooking | solar power and wind power |
saving and investing | a debit card and a credit card | Spanish and Italian as languages to learn |
the piano and the guitar for beginners | baking and frying | a frog and a toad |
a hurricane and a tornado | a meteor and a meteorite | a moth and a butterfly |
a republic and a monarchy | a rabbit and a hare | an ocean and a sea | a dolphin and a shark |
stocks and bonds | a laptop and a desktop computer | Android and iPhone | email and instant messaging |
working at a startup and at a large company | a hotel and a hostel | camping and staying in a cabin |
cycling and driving to work | public schools and homeschooling | soccer and rugby |
a novel and a short story | a poem and a song | weights and cardio | brown rice and white rice |
Roman numerals and Arabic numerals | an igloo and a tent | a violin and a cello |
a volcano and a geyser | a river and a canal | the Arctic and the Antarctic |
a mountain bike and a road bike | renting a car and taking the bus on vacation |
a museum and a zoo for a school trip | baking bread by hand and with a bread machine"""

COMPARE_TEMPLATES = [
    "Compare {a} and {b}.",
    "What is the difference between {a} and {b}?",
    "What are the pros and cons of {a} versus {b}?",
    "Which is better, {a} or {b}? Give arguments for both sides.",
    "Make a short table comparing {a} and {b}.",
]

EMAILS = """my manager, asking for a day off next Friday |
my team, explaining that our weekly meeting is moving to Thursday |
my landlord, reporting that the heater in my apartment is broken |
a coworker, thanking them for helping me finish a big project |
a friend, inviting them to my birthday dinner on Saturday |
my teacher, asking for an extension on my history essay |
an online store, asking for a refund for a damaged order |
a hiring manager, following up after a job interview last week |
a hotel, confirming a reservation for two nights in June |
my neighbors, letting them know we're having a small party on Saturday evening |
a customer, apologizing for a late delivery |
a professor, asking to join their research project |
my gym, cancelling my membership |
a client, sending the final version of a report |
my child's school, explaining that my son will miss two days for a family trip |
a local newspaper, suggesting a story about our community garden |
a new colleague, welcoming them to the team |
my team, announcing that I am leaving the company |
a plumber, asking for a quote to fix a leaking pipe |
the city council, asking them to add a pedestrian crossing near our school |
a friend I haven't spoken to in years, catching up |
a conference organizer, asking about vegetarian meal options |
my bank, asking why I was charged a fee |
a volunteer group, offering to help at their next event |
my roommate, suggesting a cleaning schedule"""

EMAIL_TEMPLATES = [
    "Write a short email to {e}.",
    "Write a polite, professional email to {e}.",
    "Help me write a friendly email to {e}. Keep it under 120 words.",
    "Draft an email to {e}.",
]

CHARACTERS = """a shy robot | an old fisherman | a curious cat | a young chef | a lost astronaut | a nervous tour guide |
a girl who lives in a lighthouse | a retired teacher | a talking tree | a dragon who is afraid of fire |
a lonely lighthouse cat | a grumpy baker | a boy who collects rocks | a brave little mouse |
a librarian with a secret | a detective dog | a kid who wants to be an inventor | an elderly gardener |
a penguin who wants to fly | a bus driver | a small town mayor | a musician who lost her voice |
a clumsy wizard | a girl with a red bicycle | a new student | a ghost who is afraid of people | a farmer with a stubborn goat"""

SITUATIONS = """finds a mysterious map | learns to make a new friend | gets lost in a big city |
discovers a hidden talent | has to solve a mystery at school | wakes up able to talk to animals |
enters a baking competition | finds a door that wasn't there yesterday | has to save the town festival |
learns an important lesson about honesty | goes on a trip to the mountains |
tries to break a world record | finds a message in a bottle | must fix a broken time machine |
plants a magical seed | gets stuck in an elevator with a stranger | moves to a new country |
receives a letter from the future | loses something very important | wins a prize they didn't expect |
spends a night in a museum | tries to cheer up a sad friend"""

STORY_TEMPLATES = [
    "Write a short story about {c} who {s}.",
    "Write a bedtime story for children about {c} who {s}.",
    "Write a 100-word story about {c} who {s}.",
    "Write a funny short story about {c} who {s}.",
    "Tell me a short story with a happy ending about {c} who {s}.",
]

POEM_SUBJECTS = """the ocean at night | a rainy Monday morning | the first day of spring | an old friend |
a cup of hot coffee | city lights | a mountain sunrise | a lost sock | a quiet library | the last day of summer |
a grandmother's kitchen | snow falling on a small town | a long train journey | the moon over the sea |
a busy market | a forgotten garden | learning to ride a bike | a thunderstorm | home | a cat sleeping in the sun |
the smell of fresh bread | walking in the forest | a new beginning | the stars on a clear night |
an empty beach in winter | a river | friendship | hope | courage | the wind"""

POEM_TEMPLATES = [
    "Write a short poem about {p}.", "Write a haiku about {p}.",
    "Write a four-line rhyming poem about {p}.", "Write a limerick about {p}.",
    "Write a free-verse poem about {p}.", "Write an acrostic poem about {p}.",
]

OTHER_WRITING = """Write a product description for a reusable water bottle. |
Write a product description for a pair of noise-cancelling headphones. |
Write a product description for a handmade wooden chess set. |
Write a short speech for a friend's wedding. | Write a short speech for a school graduation. |
Write a toast for my parents' 30th anniversary. | Write a birthday message for my grandmother. |
Write a birthday message for a coworker I don't know very well. |
Write a short review of an imaginary Italian restaurant. | Write a short review of an imaginary bookshop café. |
Write a dialogue between a customer and a waiter at a busy restaurant. |
Write a dialogue between two friends planning a camping trip. |
Write a short advertisement for a neighborhood bake sale. | Write a short announcement for a lost dog poster. |
Write a motivational message for someone starting a new job. | Write a get-well-soon card message for a friend. |
Write a short LinkedIn post about finishing an online course. | Write a short welcome message for a new website. |
Write a riddle and give the answer. | Write three tongue twisters. | Write a short fable with a moral. |
Write a diary entry from the point of view of a dog. | Write a letter to your future self. |
Write a short letter to a pen pal in another country. | Write a set of rules for a family game night. |
Write a short description of a sunset for a novel. | Write the opening paragraph of a mystery novel. |
Write a short packing checklist for a beach holiday. | Write a short job advertisement for a part-time barista. |
Write a short note to a teacher thanking them at the end of the year. |
Write a short message to cancel plans with a friend politely. | Write five creative names for a coffee shop. |
Write a short slogan for a recycling campaign. | Write a thank-you message to a nurse. |
Write a short invitation to a neighborhood clean-up day. | Write a short bio for a freelance photographer."""

WORDS = """resilient | ambiguous | empathy | meticulous | procrastinate | nostalgia | sustainable | ephemeral |
candid | diligent | benevolent | frugal | inevitable | pragmatic | serendipity | skeptical | tenacious |
versatile | whimsical | altruism | eloquent | gregarious | humble | integrity | jovial | lethargic | mundane |
obsolete | optimistic | paradox | quaint | redundant | spontaneous | trivial | ubiquitous | vivid | zealous |
metaphor | irony | hypothesis | curious | generous | ancient | fragile | abundant | reluctant | sincere |
cautious | enormous | gradual | hesitant | loyal | modest | notorious | peculiar | persistent | rigid |
subtle | thrive | vague | wander | yearn | collaborate | compromise | consequence | dilemma | innovate |
meander | perspective | resourceful | tranquil | vulnerable | wholesome | anecdote | bittersweet | cozy"""

WORD_TEMPLATES = [
    "Define the word \"{w}\" and use it in a sentence.",
    "What does \"{w}\" mean?",
    "Give me a synonym and an antonym for \"{w}\".",
    "Explain the meaning of \"{w}\" with two example sentences.",
    "How would you explain the word \"{w}\" to a child?",
]

ADVICE = """have too much homework and feel overwhelmed | want to learn the guitar but have little free time |
keep forgetting my friends' birthdays | am nervous about giving a presentation at work |
spend too much money on takeout food | want to get better at chess | have a noisy upstairs neighbor |
am thinking about changing careers to become a nurse | can't decide between two job offers |
want to eat healthier but don't like vegetables | am starting university next month |
want to read more books but always get distracted | feel stuck in my current job |
want to adopt a dog but live in a small apartment | have an argument with my best friend |
want to learn to cook but don't know where to start | am going to live abroad for a year |
want to save for a car | am bored on weekends | struggle to wake up early |
have to work with a difficult coworker | want to start a small online shop |
want to volunteer but don't know where | get distracted by my phone while studying |
want to plan a surprise party for my sister | am learning English and feel embarrassed to speak |
feel nervous about driving on the highway | want to grow tomatoes on my balcony |
have a big exam in two weeks | want to write a novel but never finish anything |
am a new manager and want to be a good one | forget what I read in books |
want to make my small bedroom feel bigger | want to teach my kids about money"""

ADVICE_TEMPLATES = [
    "I {s}. What should I do?", "Can you give me some advice? I {s}.",
    "I {s}. Any tips?", "What would you suggest? I {s}.",
]

TASKS = """remove a coffee stain from a shirt | unclog a sink drain | iron a dress shirt | fold a fitted sheet |
clean a microwave | organize a small closet | pack a suitcase efficiently | fix a flat bike tire |
hang a picture frame straight | save money on groceries | plan a birthday party for a child |
care for a new puppy | get my cat to use a scratching post | start a vegetable garden |
keep my kitchen clean every day | choose a ripe watermelon | split bills fairly with roommates |
prepare for a power outage | learn to swim as an adult | memorize a speech | write a good apology |
stop procrastinating | keep a journal | declutter my living room | wash a wool sweater |
remove rust from garden tools | jump-start a car battery | take care of leather shoes |
choose a laptop for school | set up a home Wi-Fi network | be on time more often |
make a to-do list that actually works | get better at public speaking | politely say no to extra work |
teach a child to ride a bike | lower my electricity bill | build a reading habit | plan a picnic |
prepare for a camping trip | write a cover letter | ask for a raise | clean windows without streaks |
get rid of fruit flies | make my phone battery last longer | back up photos from my phone |
change a light bulb safely | defrost a freezer | paint a room | sew a button back on |
train for a 5K walk | keep cut flowers fresh longer | remember people's names | study for a math test |
learn touch typing | write a thank-you card | make a budget-friendly gift | clean a cast iron pan"""

TASK_TEMPLATES = [
    "How do I {t}?", "What's the easiest way to {t}?",
    "Give me step-by-step instructions to {t}.", "My friend wants to {t}. What advice would you give?",
    "What are some tips to {t}?",
]

LISTS = """fruits that are high in vitamin C | hobbies you can do at home | ways to save energy at home |
board games for families | houseplants that are hard to kill | healthy breakfast ideas |
ways to be more productive at work | classic novels worth reading | animals that live in the Arctic |
things to do on a rainy day | tips for writing a good essay | countries in South America |
musical instruments in an orchestra | ways to reduce plastic waste | fun facts about space |
names for a pet goldfish | ideas for a science fair project | ways to stay warm in winter |
benefits of learning a musical instrument | kitchen tools every beginner needs |
things to bring on a long hike | easy dinner ideas for busy weeknights | ways to make new friends as an adult |
famous landmarks in Europe | good habits for students | ways to relax after a long day |
games to play on a road trip | questions to ask a new friend | ways to be kind to strangers |
jobs that involve working with animals | vegetables that are easy to grow | inventions that changed the world |
reasons to learn a second language | ways to celebrate a friend's success | snacks to bring to a party |
skills every adult should learn | outdoor activities for the whole family | ways to practice gratitude |
careers in science | things to check before buying a used car"""

LIST_TEMPLATES = [
    "List {n} {l}.", "Give me {n} {l}.", "What are some {l}? Name {n}.",
    "Can you suggest {n} {l}?", "Make a bulleted list of {l}.",
]

OPINION = """Should kids learn to code in primary school? |
Is it worth learning to play an instrument as an adult? | Are electric cars better for the environment? |
Should homework be banned? | Is social media good or bad for teenagers? |
Is it better to travel alone or with friends? | Should cities have more bike lanes? |
Is it better to read the book before watching the movie? | Are zoos good for animals? |
Should everyone learn to cook? | Is it better to have a few close friends or many friends? |
Should schools start later in the morning? | Is breakfast really the most important meal of the day? |
Should people retire earlier? | Is it better to live near the sea or the mountains? |
Should plastic bags be banned? | Is it good to have a daily routine? |
Should people take a gap year before university? | Is it better to buy experiences or things?"""

OPINION_TEMPLATES = [
    "{q}", "{q} Give arguments for both sides.", "{q} Answer in one paragraph.",
    "{q} What do most experts say?",
]

# ------------------------------------------------------------------ math ---
NAMES = """Ava | Liam | Noah | Mia | Sofia | Lucas | Amara | Kenji | Priya | Omar | Elena | Mateo | Zoe |
Hannah | Ravi | Chloe | Diego | Fatima | Leo | Grace | Yuki | Aisha | Ben | Nadia | Carlos | Ivy |
Samuel | Lina | Jonah | Maya | Tariq | Rosa | Felix | Amelia | Kofi | Nora | Hugo | Isla | Arjun |
Lucy | Mohammed | Emma | Daniel | Chen | Olivia | Ethan | Layla | Marcus | Anya | Theo"""
ITEMS = """stickers | marbles | apples | pencils | seashells | stamps | cookies | trading cards | balloons |
books | oranges | beads | toy cars | postcards | cupcakes | flowers | eggs | coins | candles | buttons"""

def _fmt_money(c: int) -> str:
    return f"${c // 100}.{c % 100:02d}" if c % 100 else f"${c // 100}"

def math_problem(r: random.Random) -> str:
    n1, n2 = r.sample(NAME_LIST, 2)
    it = r.choice(ITEM_LIST)
    k = r.randrange(40)
    if k == 0:
        a, b = r.randint(12, 300), r.randint(5, 200)
        return f"{n1} had {a} {it}. Then {n2} gave {n1} {b} more. How many {it} does {n1} have now?"
    if k == 1:
        a = r.randint(40, 500); b = r.randint(5, a - 5)
        return f"A school library had {a} books on a shelf. On Monday, {b} of them were borrowed. How many books are still on the shelf?"
    if k == 2:
        a, b = r.randint(3, 24), r.randint(2, 15)
        return f"Each pack holds {a} {it}. If {n1} buys {b} packs, how many {it} does {n1} get?"
    if k == 3:
        a, b = r.randint(2, 12), r.randint(3, 20)
        return f"{n1} wants to share {a * b} {it} equally among {a} friends. How many {it} does each friend get?"
    if k == 4:
        q, p = r.randint(2, 9), r.randint(2, 25)
        m = q * p + r.randint(1, 60)
        return f"{n1} has ${m}. {n1} buys {q} tickets that cost ${p} each. How much money does {n1} have left?"
    if k == 5:
        h, mm, d = r.randint(1, 9), r.choice([0, 10, 15, 20, 30, 40, 45]), r.randint(75, 170)
        return f"A movie starts at {h}:{mm:02d} PM and lasts {d} minutes. What time does it end?"
    if k == 6:
        p, d = r.randint(5, 40), r.randint(4, 30)
        return f"{n1} reads {p} pages every day. How many days will it take to finish a book with {p * d} pages?"
    if k == 7:
        s = r.randint(3, 60)
        return f"A square garden has sides that are {s} meters long. What is the perimeter of the garden?"
    if k == 8:
        l, w = r.randint(4, 90), r.randint(2, 50)
        return f"What is the perimeter of a rectangle with a length of {l} m and a width of {w} m?"
    if k == 9:
        b, h = r.randrange(4, 40, 2), r.randint(3, 30)
        return f"A triangle has a base of {b} cm and a height of {h} cm. What is its area?"
    if k == 10:
        n, pct = r.choice([20, 40, 50, 60, 80, 100]), r.choice([50, 60, 70, 75, 80, 90, 95])
        while n * pct % 100:
            n += 20
        return f"A test has {n} questions. {n1} answers {pct}% of them correctly. How many questions did {n1} get right?"
    if k == 11:
        p, pct = r.randrange(20, 200, 10), r.choice([10, 20, 30, 40, 50])
        thing = r.choice(["pair of shoes", "backpack", "lamp", "board game", "winter coat", "bicycle helmet"])
        return f"A {thing} costs ${p}. During a sale, the price is reduced by {pct}%. How much does the {thing} cost during the sale?"
    if k == 12:
        a, b = r.randint(60, 100), r.randint(60, 100)
        c = r.randint(60, 100)
        while (a + b + c) % 3:
            c = r.randint(60, 100)
        return f"{n1} scored {a}, {b}, and {c} on three quizzes. What is {n1}'s average score?"
    if k == 13:
        t = r.randint(2, 6); v = r.randint(8, 30)
        return f"A cyclist rides {t * v} kilometers in {t} hours. What is the cyclist's average speed?"
    if k == 14:
        a, m = r.randint(3, 15), r.randint(2, 5)
        return f"{n1} is {a} years old. {n2}'s mother is {m} times as old as {n1}. How old is {n2}'s mother?"
    if k == 15:
        y, a = r.randint(2, 15), r.randint(5, 40)
        return f"In {y} years, {n1} will be {a + y} years old. How old is {n1} now?"
    if k == 16:
        d = r.choice([2, 3, 4, 5, 8, 10]); n = d * r.randint(2, 20)
        num = r.choice([x for x in range(1, d) if math.gcd(x, d) == 1])
        return r.choice([f"Find {num}/{d} of {n}.", f"How much is {num}/{d} of {n}?"])
    if k == 17:
        a, b = r.sample([2, 3, 4, 5, 6, 8], 2)
        return f"Add the fractions 1/{a} and 1/{b}. Write the answer in simplest form."
    if k == 18:
        u = r.choice([("meters", "centimeters", 100), ("hours", "minutes", 60), ("kilograms", "grams", 1000),
                      ("kilometers", "meters", 1000), ("days", "hours", 24), ("minutes", "seconds", 60),
                      ("liters", "milliliters", 1000), ("feet", "inches", 12), ("weeks", "days", 7)])
        v = r.randint(2, 25)
        return r.choice([f"How many {u[1]} are in {v} {u[0]}?", f"Convert {v} {u[0]} to {u[1]}."])
    if k == 19:
        a, b = r.randint(11, 99), r.randint(11, 99)
        return r.choice([f"Calculate {a} × {b}.", f"Multiply {a} by {b}.", f"What is the product of {a} and {b}?"])
    if k == 20:
        a, b = r.randint(200, 9999), r.randint(100, 5000)
        return r.choice([f"Compute {max(a, b)} - {min(a, b)}.", f"Subtract {min(a, b)} from {max(a, b)}.",
                         f"Add {a} and {b}.", f"Find the sum of {a} and {b}."])
    if k == 21:
        a, b, c = r.randint(10, 500), r.randint(10, 500), r.randint(10, 500)
        return f"What do you get when you add {a}, {b}, and {c}?"
    if k == 22:
        b, q = r.randint(3, 25), r.randint(4, 60)
        return r.choice([f"Find {b * q} ÷ {b}.", f"Divide {b * q} by {b}."])
    if k == 23:
        n = r.randint(4, 30)
        return r.choice([f"What is {n} squared?", f"What is the square root of {n * n}?"])
    if k == 24:
        n = r.randint(11, 199)
        return r.choice([f"Is {n} a prime number? Explain how you know.", f"Round {n * 7 + 3} to the nearest ten.",
                         f"Is {n} even or odd?", f"List all the factors of {n}."])
    if k == 25:
        g = r.randint(2, 12); a, b = g * r.randint(2, 9), g * r.randint(2, 9)
        return r.choice([f"What is the greatest common divisor of {a} and {b}?",
                         f"What is the least common multiple of {a} and {b}?"])
    if k == 26:
        a, x = r.randint(2, 9), r.randint(1, 15); b = r.randint(1, 30)
        return f"Solve for x: {a}x + {b} = {a * x + b}."
    if k == 27:
        nums = r.sample(range(1, 500), 5)
        return f"Order these numbers from smallest to largest: {', '.join(map(str, nums))}."
    if k == 28:
        a, b = r.randint(3, 30), r.randint(2, 25)
        return f"A farmer has {a} chickens and {b} cows. How many legs do these animals have altogether?"
    if k == 29:
        rate, t = r.randint(5, 40), r.randint(3, 30)
        return f"A printer prints {rate} pages per minute. How many pages can it print in {t} minutes?"
    if k == 30:
        x, y = r.randint(150, 1500), r.randint(150, 1500)
        bill = r.choice([b for b in (2000, 5000, 10000) if b > x + y] or [10000])
        return f"{n1} pays with a {_fmt_money(bill)} bill for two items that cost {_fmt_money(x)} and {_fmt_money(y)}. How much change should {n1} get?"
    if k == 31:
        s, w = r.randint(5, 40), r.randint(3, 20)
        thing = r.choice(["bike", "video game", "guitar", "pair of skates", "telescope", "tent"])
        return f"{n1} saves ${s} every week. How many weeks will it take to save ${s * w} for a new {thing}?"
    if k == 32:
        n, c = r.randint(20, 120), r.choice([7, 8, 12, 15])
        return f"{n} people are going on a field trip. Each van can carry {c} people. How many vans are needed?"
    if k == 33:
        a, b = r.randint(10, 60), r.randint(3, 40)
        return f"{n1} ran {a + b} laps and {n2} ran {b} laps. How many more laps did {n1} run than {n2}?"
    if k == 34:
        a, b, m = r.randint(2, 4), r.choice([12, 18, 20, 24, 30]), r.randint(2, 5)
        return f"A recipe uses {a} cups of flour to make {b} cookies. How many cups of flour are needed to make {b * m} cookies?"
    if k == 35:
        t, d = r.randint(-10, 20), r.randint(3, 18)
        return r.choice([f"The temperature was {t} degrees in the morning and rose by {d} degrees by noon. What was the temperature at noon?",
                         f"The temperature was {t} degrees at sunset and dropped {d} degrees overnight. What was the temperature in the morning?"])
    if k == 36:
        q, d = r.randint(1, 15), r.randint(1, 15)
        return f"{n1} has {q} quarters and {d} dimes. How much money is that in dollars?"
    if k == 37:
        a, b, m = r.randint(1, 5), r.randint(2, 7), r.randint(2, 10)
        return f"The ratio of red marbles to blue marbles in a bag is {a}:{b}. If there are {a * m} red marbles, how many blue marbles are there?"
    if k == 38:
        l, w, h = r.randint(2, 30), r.randint(2, 20), r.randint(2, 15)
        return f"A box is {l} cm long, {w} cm wide, and {h} cm tall. What is its volume?"
    topic = r.choice(["saving pocket money", "baking cookies", "a soccer tournament", "planting trees",
                      "a bus trip", "sharing pizza", "a school fair", "painting a fence"])
    return f"Write a simple math word problem about {topic} and then solve it."

MATH_SUFFIXES = ["", "", "", " Show your work.", " Explain your reasoning step by step.",
                 " Give just the final answer.", " Explain each step."]

def gen_math(r: random.Random) -> str:
    return math_problem(r) + r.choice(MATH_SUFFIXES)

# ------------------------------------------------------------------ code ---
# (signature, what it does) -- eval.jsonl's functions are deliberately absent.
FUNCS = """count_words(text) :: returns the number of words in a string
celsius_to_fahrenheit(c) :: converts a temperature from Celsius to Fahrenheit
is_prime(n) :: checks whether a number is prime
fibonacci(n) :: returns a list with the first n Fibonacci numbers
remove_duplicates(items) :: removes duplicates from a list while keeping the original order
average(numbers) :: returns the average of a list of numbers, or None if the list is empty
count_chars(text) :: returns a dictionary that maps each character in a string to how many times it appears
is_leap_year(year) :: checks whether a year is a leap year
second_largest(numbers) :: returns the second largest distinct number in a list
merge_sorted(a, b) :: merges two sorted lists into one sorted list
flatten(nested) :: flattens a list of lists into a single list
capitalize_words(sentence) :: capitalizes the first letter of every word in a sentence
gcd(a, b) :: computes the greatest common divisor of two integers with Euclid's algorithm
binary_search(items, target) :: returns the index of target in a sorted list, or -1 if it is missing
is_anagram(a, b) :: checks whether two strings are anagrams of each other
count_positive(numbers) :: counts how many numbers in a list are greater than zero
chunk(items, size) :: splits a list into chunks of a given size
title_case(s) :: converts a string to title case without using str.title()
word_frequencies(text) :: returns the five most common words in a text with their counts
digits_sum(n) :: returns the sum of the digits of a non-negative integer
to_binary(n) :: converts a non-negative integer to its binary representation as a string
from_binary(s) :: converts a binary string like "1011" to an integer
rotate_list(items, k) :: rotates a list to the right by k positions
unique_sorted(items) :: returns the unique values of a list in sorted order
find_missing(numbers, n) :: finds the one missing number in a list containing 1 to n
is_sorted(items) :: checks whether a list is sorted in ascending order
longest_word(sentence) :: returns the longest word in a sentence
caesar_cipher(text, shift) :: encrypts text with a Caesar cipher
count_lines(path) :: counts the number of lines in a text file
read_csv_column(path, column) :: reads a CSV file and returns all the values in one column
dict_invert(d) :: swaps the keys and values of a dictionary
filter_long_words(words, n) :: returns only the words longer than n characters
running_total(numbers) :: returns a list of running totals
seconds_to_hms(seconds) :: converts a number of seconds into hours, minutes and seconds
bmi(weight_kg, height_m) :: calculates body mass index and returns it rounded to one decimal
grade(score) :: converts a score from 0 to 100 into a letter grade A to F
matrix_transpose(m) :: transposes a matrix stored as a list of lists
pairs_with_sum(numbers, target) :: finds all pairs of numbers in a list that add up to a target
compress(s) :: compresses a string like "aaabcc" into "a3b1c2"
mask_email(email) :: hides all but the first letter of the part of an email address before the @
validate_password(pw) :: checks that a password has at least 8 characters, a digit and an uppercase letter
count_even_odd(numbers) :: returns how many even and how many odd numbers are in a list
multiplication_table(n) :: prints the multiplication table for n from 1 to 10
triangle_type(a, b, c) :: says whether a triangle is equilateral, isosceles or scalene
shopping_total(prices, tax_rate) :: adds up a list of prices and applies a sales tax
days_between(d1, d2) :: returns the number of days between two dates given as "YYYY-MM-DD" strings
is_valid_ip(s) :: checks whether a string is a valid IPv4 address
snake_to_camel(name) :: converts a snake_case name to camelCase
camel_to_snake(name) :: converts a camelCase name to snake_case
power_set(items) :: returns all subsets of a small list
roman_to_int(s) :: converts a Roman numeral to an integer
int_to_roman(n) :: converts an integer between 1 and 3999 to a Roman numeral
bubble_sort(items) :: sorts a list using bubble sort
insertion_sort(items) :: sorts a list using insertion sort
group_by_length(words) :: groups words into a dictionary keyed by word length
safe_divide(a, b) :: divides two numbers and returns None when dividing by zero
clamp(x, low, high) :: limits a number to a given range
histogram(numbers) :: prints a simple text histogram using * characters
count_substring(text, sub) :: counts how many times a substring appears in a string, including overlaps
median(numbers) :: returns the median of a list of numbers
mode(numbers) :: returns the most common value in a list
dedupe_emails(emails) :: removes duplicate email addresses, ignoring upper and lower case
char_positions(text, ch) :: returns every index where a character appears in a string
simple_interest(p, r, t) :: computes simple interest
compound_interest(p, r, n) :: computes the balance after n years of yearly compound interest
parse_key_values(s) :: turns a string like "a=1;b=2" into a dictionary
top_n(scores, n) :: returns the n highest scores from a dictionary of names to scores
is_perfect_square(n) :: checks whether a number is a perfect square
collatz_steps(n) :: counts the steps of the Collatz sequence until it reaches 1
random_password(length) :: generates a random password with letters and digits
countdown(n) :: prints a countdown from n to 1 and then "Liftoff!"
guess_number() :: plays a number guessing game with the user in the terminal
stack_push_pop() :: shows how to use a list as a stack
queue_example() :: shows how to use collections.deque as a queue
word_lengths(sentence) :: returns a list with the length of each word in a sentence
sum_of_squares(n) :: returns the sum of the squares of the numbers from 1 to n
remove_punctuation(text) :: removes punctuation characters from a string
longest_common_prefix(words) :: finds the longest common prefix of a list of strings
normalize_whitespace(text) :: collapses repeated spaces and strips the ends of a string
acronym(phrase) :: builds an acronym from the first letters of a phrase
leap_years_between(a, b) :: lists the leap years between two years
is_armstrong(n) :: checks whether a number is an Armstrong number
time_greeting(hour) :: returns "Good morning", "Good afternoon" or "Good evening" for a given hour"""

FUNC_TEMPLATES = [
    "Write a Python function `{sig}` that {d}.",
    "Write a Python function that {d}.",
    "In Python, how would I write a function that {d}?",
    "Can you show me a short Python function that {d}?",
    "Implement `{sig}` in Python. It {d}.",
    "I need a Python function called `{name}` that {d}. Can you write it?",
]
FUNC_SUFFIXES = ["", "", "", " Include a docstring.", " Add an example of how to call it.",
                 " Keep it simple.", " Then explain how it works.", " Add a couple of test cases."]

PY_CONCEPTS = """for loops | while loops | if, elif and else | functions and return values | default arguments |
*args and **kwargs | dictionaries | sets | f-strings | slicing | lambda functions | map and filter |
generators | the yield keyword | decorators | classes and objects | inheritance | the __init__ method |
modules and imports | virtual environments | the with statement | recursion | the enumerate function |
the zip function | the range function | type hints | None | mutable and immutable objects |
global and local variables | integer division and the modulo operator | string methods |
the json module | the csv module | the random module | the datetime module | unit tests with pytest |
big-O notation | binary search | stacks and queues | hash tables | linked lists | dataclasses |
the collections.Counter class | sorting with a key function | list indexing and negative indexes |
string concatenation and join | boolean logic with and, or and not | nested loops |
reading user input with input() | pip and installing packages | the __name__ == "__main__" check"""

CONCEPT_TEMPLATES = [
    "Explain {c} in Python with a short example.",
    "Can you teach me about {c} in Python? I'm a beginner.",
    "Give me three small examples that show {c} in Python.",
    "When and why would I use {c} in Python?",
    "Write a short tutorial on {c} in Python.",
]

PY_DIFFS = """== and is | a for loop and a while loop | append() and extend() | sort() and sorted() |
a function and a method | print and return | a set and a list | break and continue |
import module and from module import name | a shallow copy and a deep copy | str() and repr() |
a dictionary and a list | / and // | a class and an instance | a script and a module |
local and global variables | a generator and a list | pip and conda | None and False | remove() and pop()"""

DIFF_TEMPLATES = [
    "What is the difference between {a} and {b} in Python?",
    "In Python, when should I use {a} instead of {b}?",
    "Explain {a} versus {b} in Python with examples.",
]

SNIPPETS = [
    "numbers = [3, 8, 1, 6]\nnumbers.sort()\nprint(numbers[-1])",
    "words = ['apple', 'kiwi', 'banana']\nlengths = [len(w) for w in words]\nprint(lengths)",
    "total = 0\nfor i in range(1, 6):\n    total += i\nprint(total)",
    "name = 'world'\nprint(f'Hello, {name.upper()}!')",
    "ages = {'Ann': 31, 'Bo': 25}\nfor person, age in ages.items():\n    print(person, age + 1)",
    "s = 'banana'\nprint(s.count('a'), s.find('n'), s[::-1])",
    "def greet(name='friend'):\n    return 'Hi ' + name\n\nprint(greet())\nprint(greet('Sam'))",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "evens = list(filter(lambda n: n % 2 == 0, range(10)))\nprint(evens)",
    "import random\nrandom.seed(1)\nprint(random.choice(['red', 'green', 'blue']))",
    "n = 10\nwhile n > 0:\n    n -= 3\nprint(n)",
    "pairs = list(zip('abc', [1, 2, 3]))\nprint(dict(pairs))",
    "class Dog:\n    def __init__(self, name):\n        self.name = name\n    def speak(self):\n        return self.name + ' says woof'\n\nprint(Dog('Rex').speak())",
    "def f(n):\n    if n <= 1:\n        return 1\n    return n * f(n - 1)\n\nprint(f(4))",
    "text = 'the cat and the hat'\nprint(text.split().count('the'))",
    "data = [('b', 2), ('a', 3), ('c', 1)]\nprint(sorted(data, key=lambda p: p[1]))",
    "from collections import Counter\nprint(Counter('mississippi').most_common(2))",
    "nums = [4, 7, 1]\nfor i, n in enumerate(nums):\n    print(i, n * 2)",
    "try:\n    value = int('abc')\nexcept ValueError:\n    value = 0\nprint(value)",
    "matrix = [[1, 2], [3, 4]]\nprint([row[0] for row in matrix])",
    "def gen():\n    yield 1\n    yield 2\n\nprint(sum(gen()))",
    "print(7 // 2, 7 % 2, 7 / 2, 2 ** 3)",
    "items = ['a', 'b', 'c', 'd']\nprint(items[1:3], items[-1])",
    "import json\nprint(json.dumps({'ok': True, 'count': 3}))",
    "seen = set()\nfor ch in 'hello':\n    seen.add(ch)\nprint(len(seen))",
]
SNIPPET_TEMPLATES = [
    "What does this Python code print?\n\n{s}",
    "Walk me through this Python snippet line by line:\n\n{s}",
    "What is the output of the following code, and why?\n\n```python\n{s}\n```",
    "Can you explain this code to a beginner?\n\n```python\n{s}\n```",
]

BUGS = [
    ("return the average of a list", "def average(nums):\n    return sum(nums) / len(nums) - 1"),
    ("count down from n to 1", "def countdown(n):\n    while n > 0:\n        print(n)"),
    ("check if a number is even", "def is_even(n):\n    return n % 2 == 1"),
    ("return the last item of a list", "def last(items):\n    return items[len(items)]"),
    ("add an item to a list that starts empty", "def add(item, items=[]):\n    items.append(item)\n    return items"),
    ("greet a user by name", "def greet(name):\n    print('Hello, ' + name)\n\nmessage = greet('Ana')\nprint(message.upper())"),
    ("sum the numbers from 1 to n", "def total(n):\n    s = 0\n    for i in range(n):\n        s += i\n    return s"),
    ("find the largest number", "def biggest(nums):\n    best = 0\n    for n in nums:\n        if n > best:\n            best = n\n    return best"),
    ("convert a string to an integer and double it", "def double(s):\n    return s * 2"),
    ("compare two strings ignoring case", "def same(a, b):\n    return a.lower == b.lower"),
    ("print each character on its own line", "for i in range(len(word)):\n    print(word)"),
    ("count how many times a word appears", "def count(text, word):\n    return text.count(word)\n\nprint(count('Cat cat CAT', 'cat'))"),
    ("build a list of squares", "squares = []\nfor i in range(5):\n    squares = i * i\nprint(squares)"),
    ("read all lines from a file", "f = open('notes.txt')\nlines = f.readlines\nprint(len(lines))"),
]
BUG_TEMPLATES = [
    "This Python code should {goal}, but it doesn't work. Can you find the bug?\n\n```python\n{code}\n```",
    "I wrote this to {goal}. What's wrong with it?\n\n{code}",
    "Fix the bug in this code. It is supposed to {goal}.\n\n```python\n{code}\n```",
]

OTHER_CODE = """Write a SQL query that selects all customers from the city of Denver. |
Write a SQL query that counts how many orders each customer has placed. |
Write a SQL query that finds the five most expensive products in a products table. |
Explain what a JOIN does in SQL with a simple example. |
What is the difference between WHERE and HAVING in SQL? |
Write a JavaScript function that returns the largest of three numbers. |
Write a JavaScript function that capitalizes the first letter of a string. |
Explain the difference between let, const and var in JavaScript. |
What does the map() method do for arrays in JavaScript? |
Write a bash command that counts the lines in every .txt file in a folder. |
How do I list all files in a directory, including hidden ones, in the terminal? |
What does the git command `git status` tell you? |
Explain what `git commit` and `git push` do. |
How do I create a new branch in git and switch to it? |
Write a simple HTML page with a heading and a paragraph. |
What is the difference between HTML and CSS? |
Explain what JSON is and show a small example. |
What is an API, and how does a program use one? |
What is the difference between a compiled and an interpreted language? |
Explain what a variable is to someone who has never programmed. |
What is pseudocode? Write pseudocode for making a cup of tea. |
Explain what an infinite loop is and how to avoid one. |
What are good habits for naming variables? |
Why is it useful to write comments in code? |
What is a bug, and what are some simple ways to find bugs? |
What is the difference between a syntax error and a logic error? |
How would you explain object-oriented programming to a beginner? |
Explain what recursion is using a real-life example. |
What is a regular expression? Give a simple example in Python. |
What is the difference between a list in Python and an array in C? |
What does it mean for code to be readable? |
How do I measure how long a piece of Python code takes to run? |
How do I install a Python package with pip? |
What is a virtual environment in Python and why would I use one? |
Write a Python class `BankAccount` with deposit and withdraw methods. |
Write a Python class `Rectangle` with methods for area and perimeter. |
Write a Python class `Counter` that can be incremented, decremented and reset. |
Write a Python script that asks the user for their name and age and prints a greeting. |
Write a Python program that prints a simple multiplication quiz and checks the answers. |
Write a Python program that simulates rolling two dice 1000 times and prints how often each total appears. |
Write a Python program that reads numbers from the user until they type "done" and then prints the total. |
Write a small Python to-do list program that can add, remove and show tasks."""

def _func_rows():
    out = []
    for line in FUNCS.splitlines():
        sig, d = (x.strip() for x in line.split("::"))
        out.append((sig, sig.split("(")[0], d))
    return out

def gen_code(r: random.Random) -> str:
    k = r.random()
    if k < 0.45:
        sig, name, d = r.choice(FUNC_ROWS)
        return r.choice(FUNC_TEMPLATES).format(sig=sig, name=name, d=d) + r.choice(FUNC_SUFFIXES)
    if k < 0.60:
        return r.choice(CONCEPT_TEMPLATES).format(c=r.choice(PY_CONCEPT_LIST))
    if k < 0.68:
        a, b = r.choice(PY_DIFF_PAIRS)
        return r.choice(DIFF_TEMPLATES).format(a=a, b=b)
    if k < 0.78:
        return r.choice(SNIPPET_TEMPLATES).format(s=r.choice(SNIPPETS))
    if k < 0.86:
        goal, code = r.choice(BUGS)
        return r.choice(BUG_TEMPLATES).format(goal=goal, code=code)
    return r.choice(OTHER_CODE_LIST)

# --------------------------------------------------------- summarization ---
# Paragraphs are assembled from per-genre sentence pools, so the drafter sees
# 80-150 word inputs of many shapes: news, emails, reviews, reports, stories.
TOWNS = """Ashford | Brookvale | Cedar Falls | Eastwick | Fairhaven | Glenmore | Harborview | Kingsbridge |
Lakewood | Maple Ridge | Northgate | Oakdale | Pinecrest | Riverton | Stonebridge | Westfield | Willow Creek |
Silver Bay | Elmstead | Hollow Springs | Redcliff | Thornbury | Bramley | Sandport"""
SURNAMES = """Garcia | Okafor | Novak | Tanaka | Silva | Haddad | Johansson | Mensah | Kowalski | Rossi | Nguyen |
Fischer | Patel | Moreau | O'Brien | Kim | Alvarez | Lindqvist | Osei | Costa | Dubois | Reyes | Yilmaz | Schmidt"""
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]

PROJECTS = [
    ("opened a new public park along the river", "park", "give families a safe place to spend time outdoors",
     ["a playground", "walking paths", "a small pond", "picnic tables", "an outdoor stage", "a fenced dog area"]),
    ("reopened its historic train station after a long restoration", "station", "bring more visitors to the town center",
     ["a restored clock tower", "a new waiting room", "a small café", "bike parking", "an elevator to the platforms"]),
    ("launched a free bike-sharing program", "program", "reduce traffic in the town center",
     ["two hundred bikes", "thirty docking stations", "a phone app", "child seats on some bikes", "free helmets"]),
    ("finished repairs on the old stone bridge that links the two halves of town", "bridge", "make the daily trip safer for thousands of drivers and walkers",
     ["wider sidewalks", "new railings", "brighter street lights", "a separate bike lane"]),
    ("opened a new community center next to the high school", "center", "give young people and seniors a place to meet",
     ["a gym", "a kitchen for cooking classes", "a music room", "a computer lab", "a rooftop garden"]),
    ("built a new skate park on an empty lot near the harbor", "skate park", "give teenagers something to do after school",
     ["ramps for beginners", "a large bowl", "benches for parents", "night lighting", "a water fountain"]),
    ("opened an indoor farmers market in a former factory", "market", "support local farmers all year round",
     ["forty stalls", "a bakery", "a cheese shop", "a space for live music", "a children's corner"]),
    ("finished a new swimming pool for the public", "pool", "let more children learn to swim",
     ["a lap pool", "a shallow pool for toddlers", "a small water slide", "changing rooms", "a sunny terrace"]),
]
FUNDING = ["a state grant", "local taxes", "donations from residents and businesses",
           "a mix of public money and private donations", "a loan that the town will repay over twenty years"]
DELAYS = ["heavy rain in the spring", "a shortage of building materials", "disagreements over the design",
          "the discovery of old pipes under the site", "a lack of workers during the summer"]
FUTURES = ["add more lighting", "extend the opening hours", "hold monthly events there",
           "ask residents for ideas for the next project", "add more parking nearby", "plant more trees in the area"]

def para_news(r, v):
    intro, short, benefit, feats = r.choice(PROJECTS)
    f = r.sample(feats, 3)
    s = [f"On {v['day']}, the town of {v['town']} {intro}.",
         r.choice([f"The {short} includes {f[0]}, {f[1]}, and {f[2]}.",
                   f"Visitors will find {f[0]}, {f[1]}, and {f[2]}."]),
         f"The project cost about {v['money']} and was paid for by {r.choice(FUNDING)}.",
         f"Work began {v['n1']} months ago but was delayed by {r.choice(DELAYS)}.",
         r.choice([f"\"We have waited a long time for this, and it was worth it,\" said Mayor {v['first']} {v['last']}.",
                   f"Mayor {v['first']} {v['last']} said the {short} would {benefit}.",
                   f"\"This will {benefit} for many years,\" said council member {v['first']} {v['last']}."]),
         r.choice([f"More than {v['crowd']} people came on the first day, and many said they were impressed.",
                   f"Some residents complained about the cost, but most of the {v['crowd']} people at the opening seemed happy.",
                   f"Local shop owners hope the {short} will bring more customers to their businesses."]),
         f"The town plans to {r.choice(FUTURES)} next year."]
    return s

ANNOUNCEMENTS = [
    ("we are switching to a new expense system called {tool}", "All expense reports must be submitted through {tool} starting {month} 1.",
     "Training sessions will be held on {day} at 10 a.m. and 3 p.m.", "Old paper forms will no longer be accepted after the end of the month."),
    ("the building will be closed for maintenance on the weekend of {month} {d1}", "The heating system and elevators will be inspected.",
     "Please take home anything you need, including laptops and chargers.", "Security staff will be on site, but no one will be allowed to enter."),
    ("our holiday schedule for {month} has been confirmed", "The office will close early on {day}, {month} {d1}, and stay closed for {n1} days.",
     "Customer support will still answer emails, but more slowly than usual.", "Please add your vacation days to the shared calendar by next Friday."),
    ("all employees must complete a short online security training", "The course takes about {n1} minutes and covers passwords, phishing emails, and safe use of public Wi-Fi.",
     "Anyone who does not finish by {month} {d1} will lose access to email until they do.", "Managers will receive a weekly report showing who has completed it."),
    ("the parking rules are changing", "From {month} {d1}, each employee will need a new permit to park in the garage.",
     "Permits can be picked up at the front desk on {day}.", "Employees who cycle to work can now use a new locked bike room on the ground floor."),
    ("we will start a volunteer day program", "Every employee can now take one paid day per year to volunteer for a charity of their choice.",
     "Last year, a small pilot group helped at food banks and animal shelters.", "Please tell your manager at least two weeks before your volunteer day."),
    ("our team is getting a new project management tool called {tool}", "All tasks from the old system will be copied over on {day}.",
     "Please do not create new tasks in the old system after that date.", "A short video guide will be shared in the team channel."),
]
TOOLS = ["TaskHive", "Ledgerly", "PlanBoard", "ClearSpend", "Workwise", "Trackit"]

def para_email(r, v):
    a, *rest = r.choice(ANNOUNCEMENTS)
    fill = lambda t: t.format(tool=r.choice(TOOLS), **v)
    s = [r.choice(["Hi everyone,", "Dear team,", "Hello all,"]) + "\n",
         fill(r.choice(["I'm writing to let you know that " + a + ".", "Quick update: " + a + ".",
                        "As discussed in last week's meeting, " + a + "."]))]
    s += [fill(x) for x in rest]
    s.append(r.choice(["We know changes like this can be inconvenient, and we thank you for your patience.",
                       "This change is part of our plan to make daily work simpler for everyone.",
                       "Several of you asked for this, so we hope it helps."]))
    s.append(f"If you have any questions, please contact {v['first']} {v['last']} in {r.choice(['operations', 'human resources', 'IT', 'the front office'])}.")
    s.append("\n" + r.choice(["Thanks,", "Best regards,", "Thank you,"]) + f"\n{v['first2']}")
    return s

PRODUCTS = [
    ("wireless earbuds", ["the sound is clear and balanced", "they connect to my phone instantly", "the battery lasts almost a full day", "the case is small enough for any pocket"],
     ["they fall out when I run", "the touch controls are too sensitive", "the microphone sounds muffled on calls"]),
    ("blender", ["it crushes ice in seconds", "the jug is easy to clean", "it has a handy pulse button", "it feels very solid"],
     ["it is extremely loud", "the lid is hard to remove", "it takes up a lot of counter space"]),
    ("hiking backpack", ["the straps are comfortable even on long days", "there are plenty of pockets", "the rain cover works well", "it is lighter than it looks"],
     ["the side pockets are too tight for big bottles", "the zippers feel cheap", "it only comes in two colors"]),
    ("two-person tent", ["it goes up in about ten minutes", "it stayed dry during a heavy storm", "it packs down very small", "there is good airflow at night"],
     ["it is cramped for two tall people", "the pegs bend easily", "the instructions are confusing"]),
    ("e-reader", ["the screen is easy on the eyes", "the battery lasts for weeks", "it is light enough to hold in one hand", "the built-in light is adjustable"],
     ["the store app is slow", "page turns are a little sluggish", "it doesn't support some file types"]),
    ("robot vacuum", ["it cleans the whole apartment on a schedule", "it picks up a surprising amount of pet hair", "the app is simple", "it returns to its charger by itself"],
     ["it gets stuck on rugs", "the dust bin is small", "it sometimes misses corners"]),
    ("office chair", ["my back feels much better after long days", "the height and armrests are easy to adjust", "the fabric stays cool", "it was easy to assemble"],
     ["the wheels squeak on hard floors", "the headrest is not adjustable", "it is heavier than expected"]),
    ("pair of running shoes", ["they are light and well cushioned", "they were comfortable from the first run", "the grip is good on wet roads", "they look great"],
     ["the laces keep coming untied", "they wear out quickly on trails", "they run half a size small"]),
    ("rice cooker", ["the rice comes out perfect every time", "it keeps food warm for hours", "the inner pot is non-stick", "it can also steam vegetables"],
     ["the buttons are not clearly labeled", "the cord is short", "it takes longer than cooking rice on the stove"]),
    ("desk lamp", ["the light is bright but not harsh", "you can change the color temperature", "it has a USB port for charging", "the arm bends in every direction"],
     ["the base is a bit wobbly", "the touch buttons are hard to find in the dark", "it gets warm after a few hours"]),
    ("air fryer", ["food gets crispy without much oil", "it heats up very quickly", "the basket is dishwasher safe", "it is easy to use"],
     ["the basket is small for a family", "it smells like plastic at first", "the timer beeps very loudly"]),
    ("carry-on suitcase", ["the wheels roll smoothly in every direction", "it fits in overhead bins easily", "the shell survived several flights without scratches", "the inside is well organized"],
     ["the handle rattles", "it is heavy even when empty", "the lock is fiddly"]),
]
VERDICTS = ["overall I am very happy with it", "overall it does the job, although it is not perfect",
            "I have mixed feelings about it", "it has quickly become one of my favorite purchases"]

def para_review(r, v):
    prod, pros, cons = r.choice(PRODUCTS)
    p = r.sample(pros, 3); c = r.sample(cons, 2)
    return [f"I bought this {prod} about {v['n1']} {r.choice(['weeks', 'months'])} ago, and {r.choice(VERDICTS)}.",
            f"The best thing about it is that {p[0]}.",
            f"I also like that {p[1]}, and {p[2]}.",
            r.choice([f"On the negative side, {c[0]}, and {c[1]}.", f"However, {c[0]}. Also, {c[1]}."]),
            r.choice(["Customer service answered my questions quickly when I had a problem.",
                      "The packaging was mostly cardboard, which I appreciated.",
                      "Delivery took longer than promised, but it arrived in good condition."]),
            f"It cost me {v['money_small']}, which seems {r.choice(['fair', 'a little high', 'like a good deal'])} for what you get.",
            r.choice(["I would recommend it to most people, but check the size before you buy.",
                      "If the problems I mentioned don't bother you, it is a solid choice.",
                      f"I'd give it {r.choice(['three', 'four'])} out of five stars."])]

STUDIES = [
    ("short walks after meals may help control blood sugar", "adults with high blood sugar",
     "took a ten-minute walk after each meal", "kept their usual routine", "had lower blood sugar levels after dinner"),
    ("reading aloud to young children every day improves their vocabulary", "families with three-year-olds",
     "read aloud for twenty minutes each evening", "read only when they wanted to", "knew noticeably more words"),
    ("people who keep a simple gratitude diary report feeling less stressed", "office workers",
     "wrote down three good things each night", "wrote about their day in general", "reported lower stress"),
    ("students remember more when they test themselves instead of rereading notes", "university students",
     "practiced with short quizzes", "reread their notes", "scored higher on the final exam"),
    ("cooling classrooms helps students concentrate during heat waves", "schools",
     "installed simple fans and window shades", "made no changes", "saw better test results on hot days"),
    ("green spaces in cities may improve people's mood", "city residents",
     "spent thirty minutes a week in a park", "spent the same time indoors", "said they felt calmer and happier"),
    ("learning to play an instrument can improve memory in older adults", "adults over sixty-five",
     "took weekly piano lessons", "joined a discussion group instead", "did better on memory tests"),
    ("drivers take fewer risks when they can see their speed on a large road sign", "towns",
     "installed signs that show drivers their speed", "used ordinary speed limit signs", "recorded fewer speeding cars"),
]
def para_study(r, v):
    find, who, did, other, res = r.choice(STUDIES)
    lead = f"{r.choice(['Dr.', 'Professor'])} {v['first']} {v['last']}"
    return [f"A new study by researchers in {v['town']} suggests that {find}.",
            f"The team followed {v['crowd']} {who} for {v['n1']} months.",
            f"Half of the group {did}, while the others {other}.",
            f"At the end of the study, the first group {res}.",
            r.choice([f"\"The effect was larger than we expected,\" said {lead}, who led the research.",
                      f"{lead}, who led the work, said the results were encouraging but not final."]),
            r.choice(["However, the researchers warn that the study was small and did not last very long.",
                      "However, some experts point out that the participants knew which group they were in, which may have affected the results.",
                      "Other scientists say the findings need to be repeated in different countries before anyone changes their habits."]),
            r.choice(["The team now hopes to run a larger study over several years.",
                      "The researchers plan to publish their full data so others can check the results.",
                      "The next step is to find out exactly why the change works."])]

JOBS = ["nurse", "carpenter", "teacher", "baker", "engineer", "journalist", "gardener", "photographer", "chef", "pilot"]
CHILD_HOBBIES = ["drawing maps of imaginary islands", "taking apart old radios", "reading about the stars",
           "growing vegetables in tiny pots", "writing poems", "building model boats", "playing the violin"]
TURNS = ["opened a small workshop of their own", "won a national award for their work",
         "moved abroad to study", "started teaching evening classes to adults",
         "wrote a book about their experiences", "founded a charity for young people"]

def para_bio(r, v):
    n = v["first"]
    job = r.choice(JOBS)
    job = ("an " if job[0] in "aeiou" else "a ") + job
    return [f"{n} {v['last']} was born in {v['town']} in {v['year']}, the youngest of {v['n2']} children.",
            f"As a child, {n} spent hours {r.choice(CHILD_HOBBIES)}, and teachers noticed an unusual patience and curiosity.",
            f"After finishing school, {n} worked as {job} for {v['n1']} years, saving money and learning from older colleagues.",
            f"Life changed in {v['year'] + r.randint(20, 35)}, when {n} {r.choice(TURNS)}.",
            r.choice(["The first years were difficult, and there were many months with very little money.",
                      f"Friends remember that {n} never stopped asking questions, even after becoming well known."]),
            f"Over time, {n}'s work earned respect far beyond {v['town']}.",
            r.choice([f"Today, {n} lives quietly by the sea and still answers letters from young people asking for advice.",
                      f"Today, a street in {v['town']} carries {n}'s name.",
                      f"{n} once said that the secret was simple: \"Do small things well, every day.\""])]

def para_travel(r, v):
    city = r.choice(CITY_LIST)
    return [f"We arrived in {city} on a {r.choice(['rainy', 'sunny', 'windy', 'foggy'])} {v['day']} morning after {a_an(v['n1'])} {v['n1']}-hour {r.choice(['train', 'bus', 'flight', 'ferry'])} journey.",
            r.choice(["Our small hotel was hidden on a quiet street, and the owner greeted us with tea and a hand-drawn map.",
                      "Our apartment was tiny but had a balcony that looked over the rooftops."]),
            r.choice(["On the first day we walked for hours, visiting the old town, a busy market, and a museum full of strange clocks.",
                      "We spent the first day exploring on foot, getting lost in narrow streets and stopping at every bakery we passed."]),
            r.choice(["The food was the highlight: cheap, fresh, and nothing like what we eat at home.",
                      "We ate dinner at a crowded family restaurant where nobody spoke English, and it was the best meal of the trip."]),
            r.choice([f"On the third day, {v['first']} lost a wallet on the tram, but a stranger returned it that evening.",
                      "Not everything went well: a museum we wanted to see was closed, and it rained all afternoon.",
                      "The only problem was the crowds, which made the most famous sights hard to enjoy."]),
            r.choice(["On our last evening we climbed a hill to watch the sunset over the city.",
                      "Before leaving, we took a boat trip and saw the city from the water."]),
            r.choice(["We left tired and happy, already planning to come back.",
                      "It was a short trip, but it felt much longer in the best possible way."])]

def para_meeting(r, v):
    proj = r.choice(["the new company website", "the spring product launch", "the move to a new accounting system",
                     "the customer survey", "the school fundraising fair", "the mobile app update", "the community garden project"])
    return [f"The {r.choice(['marketing', 'design', 'planning', 'operations', 'volunteer'])} team met on {v['day']} to review progress on {proj}.",
            f"{v['first']} reported that about {v['pct']} percent of the work is finished and that most tasks are on schedule.",
            r.choice(["The main problem is that two team members are on leave, so testing is behind.",
                      "The biggest risk is the budget, which is already close to its limit.",
                      "The main concern is that a supplier has not yet confirmed delivery dates."]),
            r.choice(["After some discussion, the team agreed to move the deadline back by one week.",
                      "The team agreed to drop one low-priority feature to save time.",
                      "The team decided to ask the director for extra help from another department."]),
            f"{v['first2']} will send an updated plan to everyone by {MONTHS[v['mi']]} {v['d1']}.",
            r.choice(["Everyone was asked to update their tasks in the shared tracker before Friday.",
                      "Several people said the weekly meetings are too long, so future meetings will be limited to thirty minutes."]),
            f"The next meeting will be held on {r.choice(DAYS)} at {r.choice([9, 10, 11, 1, 2, 3, 4])} o'clock."]

TEAMS = ["the Harbor Hawks", "the Valley Rovers", "the City Lions", "the River Foxes", "the Mountain Bears",
         "the Coast Pirates", "the Northside Comets", "the Eastfield Wolves"]
def para_sports(r, v):
    t1, t2 = r.sample(TEAMS, 2)
    a, b = r.randint(2, 5), r.randint(0, 1)
    return [f"{t1} beat {t2} {a} to {b} on {v['day']} night in front of {v['crowd']} fans.",
            r.choice([f"{t2} started strongly and nearly scored in the first few minutes.",
                      "The first half was slow, with few chances for either side."]),
            f"{v['first']} {v['last']} opened the scoring for {t1} with a long shot just before halftime.",
            r.choice([f"After the break, {t1} controlled the game and added {a - 1} more goals.",
                      f"In the second half, {t1} scored {a - 1} more times as {t2} grew tired."]),
            (f"{t2} scored once late in the game, but it was too little, too late." if b else
             f"{t2}'s goalkeeper made several good saves, but the team could not score."),
            f"The win moves {t1} to {r.choice(['first', 'second', 'third'])} place in the league with {v['n1']} games left.",
            f"\"We played as a team tonight,\" said coach {v['first2']} {v['last2']}, \"and that is what made the difference.\""]

def para_history(r, v):
    t = v["town"]
    return [f"The village of {t} was founded in {v['year'] - 100} by a small group of {r.choice(['farmers', 'fishermen', 'miners', 'weavers'])} looking for better land.",
            f"For many years, life in {t} depended on the {r.choice(['river', 'forest', 'harbor', 'wool trade'])}, and most families worked long hours for little pay.",
            f"In {v['year'] - 40}, a railway line reached the village, and everything began to change.",
            f"New shops and a school opened, and the population grew from a few hundred to almost {r.choice([2000, 3500, 5000, 8000, 12000])} people.",
            r.choice([f"A great fire in {v['year'] - 20} destroyed much of the old center, but residents rebuilt it in stone.",
                      f"During hard times in the 1930s, many young people left {t} to find work in the cities."]),
            f"Today, {t} is known for its {r.choice(['old bridge', 'summer music festival', 'cheese', 'historic market square', 'lighthouse'])} and attracts visitors from all over the region.",
            r.choice(["A small museum near the town hall tells the story of the village.",
                      "Older residents still tell stories about the days before the railway."])]

def para_story(r, v):
    n = v["first"]
    return [f"Every morning, {n} {r.choice(['opened the little bookshop on the corner', 'walked the same path through the park', 'fed the pigeons outside the station', 'rode the early bus to the factory'])}.",
            f"It was a quiet life, and {n} liked it that way.",
            *r.choice([
                [f"One {v['day']}, a small child appeared, holding a {r.choice(['broken umbrella', 'lost kitten', 'paper boat', 'handwritten map'])} and crying.",
                 f"{n} spent the whole day helping, asking neighbors and knocking on doors to find the child's family."],
                [f"One {v['day']}, {n} found an envelope on the doorstep with no name on it.",
                 f"Curious, {n} decided to find out who had left it, even though it meant a day away from the usual routine."]]),
            r.choice([f"By evening, the mystery was solved, and {n} had met more neighbors than in the previous {v['n1']} years.",
                      f"The answer turned out to be simple, but the search led {n} to people who soon became friends."]),
            r.choice(["After that day, the mornings felt a little different.",
                      f"{n} still kept the same routine, but now people waved on the way."]),
            r.choice([f"Sometimes, {n} thought, the best changes arrive without warning.",
                      "It was not a big adventure, but it was enough."])]

def para_weather(r, v):
    season = r.choice(["spring", "summer", "autumn", "winter"])
    hot = season == "summer"
    return [f"Here is the weather outlook for {v['town']} and the surrounding area for the coming week.",
            r.choice([f"{v['day']} will start cloudy, with light rain arriving in the afternoon.",
                      f"{v['day']} should be mostly sunny, with a gentle breeze from the west."]),
            (f"Temperatures will climb to around {r.randint(28, 35)} degrees by midweek, so drink plenty of water and avoid the midday sun."
             if hot else f"Temperatures will stay between {r.randint(-3, 5)} and {r.randint(6, 14)} degrees, which is normal for {season}."),
            r.choice(["A stronger storm is expected on Thursday night, with heavy rain and gusty winds that may bring down small branches.",
                      "Thursday and Friday look dry, making them the best days for outdoor plans."]),
            r.choice(["Drivers should take care on the coast road, where fog may form early in the morning.",
                      "Farmers will welcome the rain after several dry weeks."]),
            r.choice(["The weekend looks pleasant, with clear skies and light winds.",
                      "The weekend is uncertain: forecasters say it could be either sunny or wet, depending on how fast the storm moves."]),
            "We will update this forecast every morning."]

def para_job(r, v):
    job = r.choice(["part-time barista", "library assistant", "delivery driver", "junior web developer",
                    "kitchen helper", "summer camp counselor", "receptionist at a dental clinic", "bike mechanic"])
    return [f"{r.choice(['A small family business', 'A busy local company', 'A growing nonprofit'])} in {v['town']} is looking for a {job} to join its friendly team.",
            f"The job is {r.randint(15, 40)} hours a week, with a mix of morning and evening shifts.",
            r.choice(["No experience is needed, because full training will be provided during the first two weeks.",
                      "At least one year of experience in a similar role is preferred, but not required."]),
            r.choice(["The ideal person is reliable, friendly with customers, and calm when things get busy.",
                      "We are looking for someone who is organized, curious, and happy to learn new skills."]),
            f"The pay starts at ${r.randint(15, 28)} an hour, and staff receive {r.choice(['free lunches', 'a yearly bonus', 'paid holidays', 'a transport allowance'])}.",
            f"Applications close on {v['month']} {v['d1']}, and interviews will take place the following week.",
            f"To apply, send a short letter and a list of your past jobs to {v['first']} {v['last']}."]

def para_listing(r, v):
    rooms = r.choice(["one-bedroom", "two-bedroom", "three-bedroom"])
    return [f"This bright {rooms} apartment is on the {r.choice(['second', 'third', 'fourth', 'top'])} floor of a quiet building in central {v['town']}.",
            r.choice(["The living room has large windows that let in sunlight all afternoon.",
                      "The open kitchen and living area is perfect for cooking with friends."]),
            r.choice(["The kitchen was renovated last year and includes a dishwasher and a gas stove.",
                      "The bathroom is small but modern, with a walk-in shower."]),
            r.choice(["There is no elevator, which may be a problem for some tenants.",
                      "The building has an elevator, a shared laundry room, and a bike shed."]),
            f"A supermarket, a bakery, and a bus stop are all within a {r.randint(2, 9)}-minute walk.",
            f"The rent is ${r.randint(7, 25) * 100} per month, and water is included.",
            f"The apartment is available from {v['month']} {v['d1']}. Pets are {r.choice(['welcome', 'allowed with permission', 'not allowed'])}."]

def para_school(r, v):
    return [f"It has been a busy month at {v['town']} Elementary School.",
            r.choice(["Our fourth-grade students visited the local fire station, where they learned how firefighters prepare for emergencies.",
                      "Our third-grade class planted a small herb garden behind the gym, and the first basil is already growing."]),
            f"The school choir sang at the town hall on {v['day']}, and more than {v['crowd']} people came to listen.",
            r.choice(["We also welcomed two new teachers, who will lead art and science classes.",
                      "Thanks to a parent fundraiser, the library now has three hundred new books."]),
            f"Please remember that the school will be closed on {v['month']} {v['d1']} for a teacher training day.",
            r.choice(["Parents are reminded to label jackets and lunch boxes, as the lost-and-found box is overflowing.",
                      "We are still looking for volunteers to help with the spring fair, so please contact the office if you can spare an hour."]),
            f"Thank you for your continued support. Principal {v['first']} {v['last']}"]

GENRES = [para_news, para_email, para_review, para_study, para_bio, para_travel,
          para_meeting, para_sports, para_history, para_story, para_weather, para_job,
          para_listing, para_school]

SUMMARY_AFTER = [
    "Summarize the paragraph above in one sentence.", "Summarize this in two sentences.",
    "Summarize the text above as three bullet points.", "Summarize the main points of this passage.",
    "Write a one-sentence summary of the text above.", "Give me a TL;DR of the text above.",
    "Summarize this for someone who has no time to read it.", "What is this text about? Summarize it briefly.",
    "Summarize the key facts: who, what, when, and where.", "Summarize this text in under 30 words.",
    "Summarize the passage above in a short paragraph.", "Briefly summarize what happened.",
]
SUMMARY_BEFORE = [
    "Summarize the following text in two sentences:", "Summarize this paragraph:",
    "Please write a short summary of the text below.", "Read the following passage and summarize it in one sentence.",
    "Summarize the main idea of this text:", "Give a bullet-point summary of the following:",
]

def a_an(n: int) -> str:
    return "an" if str(n).startswith("8") or n in (11, 18) else "a"

def make_values(r: random.Random) -> dict:
    first, first2 = r.sample(NAME_LIST, 2)
    return dict(day=r.choice(DAYS), town=r.choice(TOWN_LIST), first=first, first2=first2,
                last=r.choice(SURNAME_LIST), last2=r.choice(SURNAME_LIST),
                money=f"{r.randint(2, 95) / 10:.1f} million dollars".replace(".0 ", " "),
                money_small=f"${r.randint(25, 240)}", n1=r.randint(2, 18), n2=r.randint(2, 7),
                crowd=r.choice([150, 300, 450, 600, 800, 1200, 2000, 3500]), year=r.randint(1890, 1975),
                pct=r.choice([40, 50, 60, 70, 75, 80, 90]), month=r.choice(MONTHS),
                mi=r.randrange(12), d1=r.randint(1, 28))

def gen_summary(r: random.Random) -> str:
    for _ in range(50):
        para = " ".join(x[:1].upper() + x[1:] for x in r.choice(GENRES)(r, make_values(r)))
        para = para.replace("\n ", "\n").replace(" \n", "\n")
        if 80 <= len(para.split()) <= 150:
            break
    else:
        raise AssertionError("no paragraph of 80-150 words")
    if r.random() < 0.7:
        return f"{para}\n\n{r.choice(SUMMARY_AFTER)}"
    return f"{r.choice(SUMMARY_BEFORE)}\n\n{para}"

# ------------------------------------------------------------------ chat ---
def gen_chat(r: random.Random) -> str:
    k = r.random()
    if k < 0.20:
        pool = r.choice([SCIENCE_LIST, TECH_LIST, SOCIETY_LIST, ARTS_LIST, HOBBY_LIST, HISTORY_EVENT_LIST,
                         HEALTH_TOPIC_LIST])
        t = r.choice(pool)
        tmpl = r.choice(GENERIC_TEMPLATES + (WHY_TEMPLATES if pool in (SCIENCE_LIST, TECH_LIST, SOCIETY_LIST) else []))
        return tmpl.format(t=t)
    if k < 0.48:
        which = r.randrange(10)
        t, tmpls = [(r.choice(HISTORY_EVENT_LIST), HISTORY_EVENT_TEMPLATES), (r.choice(HISTORY_PEOPLE_LIST), PEOPLE_TEMPLATES),
                    (r.choice(PLACE_LIST), PLACE_TEMPLATES), (r.choice(CITY_LIST), CITY_TEMPLATES),
                    (r.choice(DISH_LIST), DISH_TEMPLATES), (r.choice(HEALTH_GOAL_LIST), HEALTH_GOAL_TEMPLATES),
                    (r.choice(TECH_LIST), TECH_TEMPLATES), (r.choice(ANIMAL_LIST), ANIMAL_TEMPLATES),
                    (r.choice(HOBBY_LIST), HOBBY_TEMPLATES), (r.choice(TASK_LIST), TASK_TEMPLATES)][which]
        return r.choice(tmpls).format(t=t, n=r.randint(2, 7), season=r.choice(["spring", "summer", "autumn", "winter"]))
    if k < 0.53:
        return r.choice(COOKING_QUESTION_LIST)
    if k < 0.60:
        return r.choice(CURIOUS_LIST)
    if k < 0.66:
        a, b = r.choice(COMPARE_PAIRS)
        return r.choice(COMPARE_TEMPLATES).format(a=a, b=b)
    if k < 0.70:
        return r.choice(EMAIL_TEMPLATES).format(e=r.choice(EMAIL_LIST))
    if k < 0.76:
        return r.choice(STORY_TEMPLATES).format(c=r.choice(CHARACTER_LIST), s=r.choice(SITUATION_LIST))
    if k < 0.80:
        return r.choice(POEM_TEMPLATES).format(p=r.choice(POEM_LIST))
    if k < 0.84:
        return r.choice(OTHER_WRITING_LIST)
    if k < 0.88:
        return r.choice(WORD_TEMPLATES).format(w=r.choice(WORD_LIST))
    if k < 0.93:
        return r.choice(ADVICE_TEMPLATES).format(s=r.choice(ADVICE_LIST))
    if k < 0.97:
        return r.choice(LIST_TEMPLATES).format(n=r.choice([3, 4, 5, 6, 7, 10]), l=r.choice(LIST_LIST))
    return r.choice(OPINION_TEMPLATES).format(q=r.choice(OPINION_LIST))

def _pairs(s: str) -> list[tuple[str, str]]:
    out = []
    for x in split(s):
        a, b = x.rsplit(" and ", 1)
        # "cats and dogs as pets" -> ("cats", "dogs as pets") reads fine in every template.
        out.append((a.strip(), b.strip()))
    return out

SCIENCE_LIST, HISTORY_EVENT_LIST, HISTORY_PEOPLE_LIST = split(SCIENCE), split(HISTORY_EVENTS), split(HISTORY_PEOPLE)
PLACE_LIST, CITY_LIST, DISH_LIST = split(PLACES), split(CITIES), split(DISHES)
COOKING_QUESTION_LIST, HEALTH_GOAL_LIST, HEALTH_TOPIC_LIST = split(COOKING_QUESTIONS), split(HEALTH_GOALS), split(HEALTH_TOPICS)
TECH_LIST, ANIMAL_LIST, SOCIETY_LIST = split(TECH), split(ANIMALS), split(SOCIETY)
ARTS_LIST, HOBBY_LIST = split(ARTS), split(HOBBIES)
CURIOUS_LIST, COMPARE_PAIRS, EMAIL_LIST = split(CURIOUS), _pairs(COMPARE), split(EMAILS)
CHARACTER_LIST, SITUATION_LIST, POEM_LIST = split(CHARACTERS), split(SITUATIONS), split(POEM_SUBJECTS)
OTHER_WRITING_LIST, WORD_LIST, ADVICE_LIST = split(OTHER_WRITING), split(WORDS), split(ADVICE)
TASK_LIST, LIST_LIST, OPINION_LIST = split(TASKS), split(LISTS), split(OPINION)
NAME_LIST, ITEM_LIST, TOWN_LIST, SURNAME_LIST = split(NAMES), split(ITEMS), split(TOWNS), split(SURNAMES)
FUNC_ROWS, PY_CONCEPT_LIST, OTHER_CODE_LIST = _func_rows(), split(PY_CONCEPTS), split(OTHER_CODE)
PY_DIFF_PAIRS = _pairs(PY_DIFFS)

GENERATORS = {"chat": gen_chat, "math": gen_math, "code": gen_code, "summarization": gen_summary}

# ------------------------------------------------------- near-duplicates ---
def normalize(text: str) -> str:
    # Digits are masked so "What is 156 + 278?" and "What is 311 + 902?" count
    # as the same prompt: a template shared with eval would leak its shape.
    text = re.sub(r"\d+", "0", text.lower())
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text).split())

def shingles(norm: str, k: int = 3) -> set[tuple[str, ...]]:
    w = norm.split()
    return {tuple(w[i:i + k]) for i in range(max(1, len(w) - k + 1))}

class EvalIndex:
    """Flags a prompt whose normalized text equals an eval prompt's, or whose
    word-trigram Jaccard similarity with one reaches JACCARD."""
    JACCARD = 0.5

    def __init__(self, eval_texts: list[str]):
        self.norms = {normalize(t) for t in eval_texts}
        self.sh = [shingles(normalize(t)) for t in eval_texts]

    def near(self, text: str) -> bool:
        n = normalize(text)
        if n in self.norms:
            return True
        s = shingles(n)
        return any(len(s & e) / len(s | e) >= self.JACCARD for e in self.sh if s & e)

def prompt_text(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages if m["role"] == "user")

def load_eval(path: pathlib.Path) -> list[str]:
    return [prompt_text(json.loads(l)["messages"]) for l in path.read_text().splitlines() if l.strip()]

# ------------------------------------------------------------------ main ---
def build(eval_texts: list[str], seed: int = SEED, counts: dict = COUNTS) -> tuple[list[dict], int]:
    r = random.Random(seed)
    index = EvalIndex(eval_texts)
    seen: set[str] = set()   # exact (case/space-insensitive) duplicates within train
    rows, rejected = [], 0
    for cat, n in counts.items():
        got, tries = 0, 0
        while got < n:
            tries += 1
            if tries > 50 * n:
                raise SystemExit(f"{cat}: only {got} distinct prompts after {tries} tries")
            text = GENERATORS[cat](r)
            key = " ".join(text.lower().split())
            if key in seen:
                continue
            if index.near(text):
                rejected += 1
                continue
            seen.add(key)
            msgs = [{"role": "user", "content": text}]
            if r.random() < SYSTEM_PROB:
                msgs.insert(0, {"role": "system", "content": r.choice(SYSTEM_PROMPTS)})
            rows.append({"category": cat, "messages": msgs})
            got += 1
    r.shuffle(rows)
    for i, row in enumerate(rows, 1):
        rows[i - 1] = {"id": f"train-{i:05d}", **row}
    return rows, rejected

def check(rows: list[dict], eval_texts: list[str]) -> None:
    index = EvalIndex(eval_texts)
    for row in rows:
        text = prompt_text(row["messages"])
        assert not index.near(text), f"{row['id']} near-duplicates an eval prompt: {text[:80]!r}"
        low = text.lower()
        assert not any(p in low for p in EVAL_ONLY_PHRASES), f"{row['id']} touches an eval-only subject"
    keys = [" ".join(prompt_text(r["messages"]).lower().split()) for r in rows]
    assert len(set(keys)) == len(keys), "duplicate prompts in train"

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", type=pathlib.Path, default=HERE / "eval.jsonl")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "train.jsonl")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check", action="store_true", help="regenerate and compare with --out instead of writing")
    args = ap.parse_args()

    eval_texts = load_eval(args.eval)
    rows, rejected = build(eval_texts, args.seed)
    check(rows, eval_texts)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    counts = {c: sum(row["category"] == c for row in rows) for c in COUNTS}
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from the generator output'}")
        sys.exit(0 if same else 1)
    args.out.write_text(text)
    print(f"wrote {len(rows)} prompts to {args.out} {counts}; "
          f"{rejected} candidates dropped as near-duplicates of {len(eval_texts)} eval prompts")

if __name__ == "__main__":
    main()
