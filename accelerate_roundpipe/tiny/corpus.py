"""A small English text shipped with the package, so examples and tests train offline.

Written for this project (no outside source). Plain prose in short paragraphs, one per line; repetitive enough in
vocabulary that a tiny model's loss falls visibly within a minute of CPU training.
"""

TEXT = """\
The river town wakes early. Before the sun clears the hills, the baker opens the shutters and the smell of bread \
drifts down to the water, where the ferryman is already checking the ropes of his boat.
The ferry crosses the river six times a day. In the morning it carries farmers and their baskets of apples; in the \
evening it carries the same farmers home, tired, with empty baskets and full pockets.
On market days the square fills with tables. There are apples and pears, cheese wrapped in cloth, jars of honey, \
bundles of herbs, and a man who sharpens knives while he tells stories about the sea.
The children of the town learn to swim in the shallow bend of the river, where the water is slow and warm and the \
stones on the bottom are round and smooth.
In winter the river freezes at the edges. The ferryman breaks the ice with a long pole, and the boat moves slowly \
through a narrow channel of dark water between two white shores.
The baker has a small notebook where she writes down every recipe she has ever tried. Some pages are covered in \
flour, and some recipes have been crossed out and written again, better, on the next page.
To make good bread you need flour, water, salt and time. The dough must rest and rise, and the baker must wait. \
Most mistakes in baking come from not waiting long enough.
The lighthouse stands on a rock at the mouth of the river. Its keeper climbs the spiral stairs every evening to \
light the lamp, and every morning to put it out and clean the glass.
From the top of the lighthouse you can see the whole coast: the harbour, the river winding inland, the fields and \
the dark line of the forest on the hills behind the town.
The keeper writes in a logbook each night. He notes the wind, the weather, the ships that pass, and sometimes a \
sentence or two about the birds that rest on the railing of the lamp room.
When a storm comes in from the sea, the waves climb the rock and the spray reaches the windows of the lamp room. \
The keeper stays awake all night and watches the light turn.
Ships that pass the lighthouse at night count the flashes. Each lighthouse on the coast has its own pattern, so a \
sailor who counts carefully always knows where he is.
The train arrives at the station at noon. It is a short train, only four carriages, and it stops for exactly ten \
minutes while the driver drinks a cup of tea on the platform.
The station master keeps a garden beside the tracks. He grows tomatoes, beans and tall yellow flowers that lean \
toward the rails as if they wanted to travel too.
Travellers who step off the train at noon usually walk straight to the square. They buy bread from the baker, an \
apple from the market, and sit by the fountain to eat.
The fountain in the square is older than any house in the town. Its water comes from a spring in the hills and is \
so cold that even in summer nobody keeps a hand in it for long.
In the school by the church, the teacher writes a new word on the board every morning. The children copy it, say \
it aloud, and try to use it in a sentence before the end of the day.
Today the word is patience. One child says that patience is waiting for the bread to rise. Another says it is \
waiting for the ferry. A third says it is waiting for the teacher to finish talking.
The teacher laughs and writes all three sentences on the board. Then she asks the children which of them is the \
hardest kind of patience, and they argue about it until the bell rings.
At the edge of the town there is a workshop where an old carpenter builds chairs. He chooses the wood himself, \
dries it for a year, and shapes each leg by hand.
A good chair, the carpenter says, must be strong, light and quiet. It must hold a person for fifty years without \
complaining, and it must not creak when someone shifts their weight.
The carpenter's apprentice is a young woman who came from the city. She already knew how to draw plans; in the \
workshop she is learning how wood moves, bends and splits.
Wood is never finished moving, the carpenter tells her. It grows in the forest, it dries in the shed, and it keeps \
changing a little in every season, even after it becomes a chair.
On Sundays the workshop is closed and the carpenter walks in the forest. He looks at the trees the way a baker \
looks at flour, thinking about what each one might become.
The forest is quiet in the morning. Light falls through the leaves in narrow bands, and the path is soft with \
needles from the tall pines that grow on the northern slope.
Deer come down to the river to drink at dusk. If you sit very still on the bank, they walk past close enough that \
you can hear them breathe.
In autumn the whole town goes to the orchards. Everyone picks apples: children climb the low branches, adults use \
ladders, and the oldest people sort the fruit into baskets.
The best apples are stored in a cool cellar for the winter. The bruised ones become cider, and the smallest ones \
are given to the horses, who wait by the fence with great patience.
The cider press is turned by hand. It takes two people to turn it, and it is a custom that they sing while they \
work, so that they keep the same rhythm.
When the harvest is done, there is a dinner in the square. Long tables are carried out of every house, and each \
family brings one dish to share with the others.
The baker brings a loaf as long as a table. The carpenter brings a bench he made for the occasion. The lighthouse \
keeper brings fish, and a story about the storm of the year before.
After dinner someone always plays music. There is a fiddle, a drum, and a small accordion that belonged to the \
ferryman's grandfather and still plays almost every note.
The stars come out over the square while people dance. From the lighthouse, the keeper can see the lanterns in the \
town and hear, very faintly, the sound of the fiddle carried on the wind.
Late at night the tables are carried back, the lanterns are put out, and the town is quiet again, except for the \
river, which never stops talking to itself.
A river is a long conversation between the hills and the sea. The hills send water down, the sea sends tides up, \
and the town sits in the middle and listens.
The ferryman knows every mood of the river. He can tell from the colour of the water whether it rained in the \
hills, and from the smell of the air whether the tide is turning.
Once a year the river floods. The water rises over the low meadows and reaches the first step of the church, and \
the children sail paper boats in the streets.
After the flood the meadows are green and rich. Farmers say that the river takes a little and gives back more, \
and they plant their beans in the soft dark soil it leaves behind.
The town has a small library above the post office. It has one window, three shelves, and a librarian who has read \
every book on them at least twice.
People borrow books for a week and bring them back with notes in the margins. The librarian does not mind; she \
says a book that has been argued with is a book that has been read.
The most borrowed book in the library is about the sea. It has pictures of ships, maps of currents, and a chapter \
about lighthouses that the keeper says is mostly correct.
In the post office below, letters arrive twice a week. Some come from the city, some from across the sea, and one \
arrives every month, without fail, for the carpenter, from his sister.
His sister writes about her garden, her neighbours and the weather. He writes back about chairs, the forest and \
the weather. They have been writing to each other for forty years.
The weather in the river town is never the same two days in a row. The wind turns, the clouds come and go, and \
the fishermen read the sky every morning before they set out.
A red sky in the morning means rain before night, the fishermen say. A red sky in the evening means a fair day \
tomorrow. The keeper writes both in his logbook and checks who was right.
Most of the time the fishermen are right. The keeper keeps count, and after ten years of notes he has found that \
the old saying is true about two days in every three.
The fishing boats return in the afternoon. Gulls follow them into the harbour, crying and circling, and the \
children run down to the quay to see what the nets have brought in.
The fish are sold on the quay while they are still bright. The baker buys two for her supper; the teacher buys one \
and a bunch of herbs; the librarian buys none, because she does not like fish.
In the evening the harbour is calm. The boats rock gently on their ropes, the water reflects the lights of the \
houses, and the lighthouse begins to turn, slowly, out on its rock.
The lamp of the lighthouse is turned by a clockwork machine. The keeper winds it every four hours, and if he is \
ever late the light slows down and the ships at sea begin to worry.
He has never been late in thirty years. Even on the night of the great storm, when the door blew open and the \
stairs were wet with spray, he climbed up and wound the clock on time.
When the keeper retires, the apprentice carpenter wants to take his place. She has already learned to wind the \
clock, clean the glass and read the sky, and she has started her own logbook.
The first line of her logbook says: wind from the west, sky clear, three ships passed, one gull on the railing, \
the light turned all night and nobody had to worry.
"""
